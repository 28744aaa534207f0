"""Environment hygiene for launched servers, and redaction of secrets in what we record.

Engines read behaviour-changing switches from the environment (SGLANG_SIMULATE_ACC_LEN commits unchecked
drafts; VLLM_* toggles kernels). A variable left over in a shell must never change an accuracy run, so the child
environment starts from the parent minus every SGLANG_* / VLLM_* name, and only what the user kept by name
(`--keep-env`) or set on purpose (`--set-env`, `--simulate-acc-len`) goes back in.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from evalpipe.launchers.errors import LaunchConfigError

CLEARED_PREFIXES = ("SGLANG_", "VLLM_")

# Simulated acceptance commits drafts without checking them: set only through the explicit performance flag.
SIMULATION_VARIABLES = ("SGLANG_SIMULATE_ACC_LEN",)

REDACTED = "<redacted>"
_ENV_SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD")
# Structured keys (argv flags, server-info fields) are matched by words, narrowly: `api_key`, `hf_token` and
# `ssl_keyfile_password` are secrets; `tokenizer_path`, `bos_token_id` and `num_key_value_heads` are settings.
_SECRET_WORDS = {"secret", "password", "passwd", "apikey", "credentials"}
_TOKEN_OWNERS = {"hf", "auth", "access", "bearer", "hub", "refresh", "session", "github", "gh", "api"}


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


def is_secret_env_name(name: str) -> bool:
    upper = name.upper()
    return any(marker in upper for marker in _ENV_SECRET_MARKERS)


def is_secret_field(name: str) -> bool:
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w]
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words) or words in (["key"], ["token"]):
        return True
    if any(a == "api" and b == "key" for a, b in zip(words, words[1:])):
        return True
    return words[-1] == "token" and len(words) > 1 and words[-2] in _TOKEN_OWNERS


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: (REDACTED if is_secret_env_name(name) and value else value) for name, value in sorted(env.items())}


def redact_argv(argv: Iterable[str]) -> list[str]:
    """Hide the value of any `--api-key K` / `--hf-token=T` style flag."""
    out: list[str] = []
    hide_next = False
    for token in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if token.startswith("--"):
            flag, sep, _ = token.partition("=")
            if is_secret_field(flag):
                if sep:
                    out.append(f"{flag}={REDACTED}")
                    continue
                hide_next = True
        out.append(token)
    return out


def redact_tree(value):
    """Recursively hide secret-named fields of a JSON-like value (server info may echo an api key)."""
    if isinstance(value, dict):
        return {
            k: (REDACTED if isinstance(k, str) and is_secret_field(k) and v not in (None, "") else redact_tree(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        if value and all(isinstance(v, str) for v in value):
            return redact_argv(value)  # an echoed command line
        return [redact_tree(v) for v in value]
    return value


def scrub_values(value, secrets: Iterable[str]):
    """Replace every occurrence of known secret strings anywhere in a JSON-like value."""
    secrets = [s for s in secrets if s and len(s) >= 4]
    if not secrets:
        return value
    if isinstance(value, dict):
        return {k: scrub_values(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_values(v, secrets) for v in value]
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
    return value
