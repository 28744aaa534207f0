"""Environment hygiene for launched servers.

Engines read behaviour-changing switches from the environment (SGLANG_SIMULATE_ACC_LEN commits unchecked
drafts; VLLM_* toggles kernels). A variable left over in a shell must never change an accuracy run, so the child
environment starts from the parent minus every SGLANG_* / VLLM_* name, and only what the user kept by name
(`--keep-env`) or set on purpose (`--set-env`, `--simulate-acc-len`) goes back in. What counts as a secret
in what we record is `evalpipe.redact`'s rule.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from evalpipe.launchers.errors import LaunchConfigError

# The redaction rule lives in evalpipe.redact; these names are what the launchers import from here.
from evalpipe.redact import REDACTED, is_secret_env_name, redact_argv, redact_env, scrub_values  # noqa: F401
from evalpipe.redact import is_secret_name as is_secret_field  # noqa: F401
from evalpipe.redact import redact as redact_tree  # noqa: F401

CLEARED_PREFIXES = ("SGLANG_", "VLLM_")

# Simulated acceptance commits drafts without checking them: set only through the explicit performance flag.
SIMULATION_VARIABLES = ("SGLANG_SIMULATE_ACC_LEN",)


@dataclass(frozen=True)
class ChildEnvironment:
    """The environment a server will get, and how it differs from the parent's."""

    env: dict[str, str]
    removed: list[str] = field(default_factory=list)  # inherited names cleared by hygiene
    kept: list[str] = field(default_factory=list)  # inherited names kept on request
    set: dict[str, str] = field(default_factory=dict)  # names the launcher set on purpose


def build_child_env(
    parent: Mapping[str, str],
    keep: Iterable[str] = (),
    set_vars: Mapping[str, str] | None = None,
) -> ChildEnvironment:
    """Parent env minus SGLANG_*/VLLM_* (except names or globs in `keep`), plus `set_vars` applied last."""
    keep = list(keep)
    set_vars = dict(set_vars or {})
    for pattern in keep:
        for name in SIMULATION_VARIABLES:
            if fnmatch.fnmatchcase(name, pattern):
                raise LaunchConfigError(
                    f"--keep-env {pattern} would keep {name}: simulated acceptance is set only by --simulate-acc-len"
                )
    env: dict[str, str] = {}
    removed, kept = [], []
    for name, value in parent.items():
        if name.startswith(CLEARED_PREFIXES):
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in keep):
                kept.append(name)
            else:
                removed.append(name)
                continue
        env[name] = value
    env.update(set_vars)
    return ChildEnvironment(env=env, removed=sorted(removed), kept=sorted(kept), set=set_vars)


def parse_assignments(items: Iterable[str]) -> dict[str, str]:
    """`NAME=VALUE` strings (from --set-env) to a dict; refuses malformed names and simulation switches."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise LaunchConfigError(f"--set-env expects NAME=VALUE, got {item!r}")
        if name in SIMULATION_VARIABLES:
            raise LaunchConfigError(f"{name} is set only by --simulate-acc-len (performance runs)")
        out[name] = value
    return out
