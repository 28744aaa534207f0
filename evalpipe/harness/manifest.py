"""Run provenance: captured at start and again at end, with a check that the two agree.

Why twice: a server restarted with other flags, a package upgraded or the dataset edited *during* a run
would otherwise go unnoticed. Changes to protocol facts (data, prompts, lane, endpoint, server, packages)
make `manifest_changed` true; a change of our own source tree mid-run (`code` section) is reported too,
but `evalpipe audit` treats it as a warning (the records themselves are still checked in full).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from evalpipe import __version__, volatile

REPO_ROOT = Path(__file__).resolve().parents[2]  # the source checkout (this file is evalpipe/harness/manifest.py)

# sections whose change between start and end means the protocol itself moved
PROTOCOL_SECTIONS = ("dataset", "prompts", "lane", "endpoint", "server", "packages", "python")
WARNING_SECTIONS = ("code",)


def _git(*args: str) -> Optional[bytes]:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def code_provenance() -> dict:
    head = _git("rev-parse", "HEAD")
    diff = _git("diff", "HEAD")
    untracked = _git("ls-files", "--others", "--exclude-standard")
    return {
        "evalpipe_version": __version__,
        "git_commit": head.decode().strip() if head else None,
        "git_dirty": bool(diff) if diff is not None else None,
        "git_diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None,
        "git_untracked_files": len(untracked.decode().split()) if untracked else 0,
    }


def installed_packages() -> list[str]:
    """Sorted `name==version` of every installed distribution.

    Read from the `*.dist-info` folder names (cheap, runs twice per run); only folders whose name carries no
    version (e.g. an editable `*.egg-info`) fall back to parsing their metadata."""
    names = set()
    for entry in dict.fromkeys(sys.path):
        base = Path(entry or ".")
        if not base.is_dir():
            continue
        for info in list(base.glob("*.dist-info")) + list(base.glob("*.egg-info")):
            stem = info.name.rsplit(".", 1)[0]
            name, sep, version = stem.partition("-")
            if not sep or not version:
                try:
                    meta = importlib.metadata.Distribution.at(info).metadata
                    name, version = meta.get("Name") or name, meta.get("Version") or ""
                except Exception:
                    continue
            names.add(f"{name.lower().replace('_', '-')}=={version}")
    return sorted(names)


def python_platform() -> dict:
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }


def capture(
    *,
    lane_desc: dict,
    overrides: dict,
    effective: dict,
    transport: dict,
    data_facts: dict,
    prompt_facts: dict,
    endpoint: dict,
    server: dict,
) -> dict:
    """One snapshot. Sections are compared key by key between start and end (`transport` is not: a resume
    may use another timeout or retry policy without changing what was asked)."""
    return {
        "captured_at": time.time(),
        "code": code_provenance(),
        "packages": installed_packages(),
        "python": python_platform(),
        "dataset": data_facts,
        "prompts": prompt_facts,
        "lane": {"spec": lane_desc, "overrides": overrides, "effective": effective},
        "transport": transport,
        "endpoint": endpoint,
        "server": server,
    }


def stable_server(obj: Any) -> Any:
    """The server facts without what changes per call or per boot (evalpipe.volatile's list, every engine)."""
    return volatile.strip_server(obj)


def differences(start: dict, end: dict) -> tuple[list[str], list[str]]:
    """(protocol changes, warning-only changes) between two snapshots, as readable strings."""

    def diff_section(name: str) -> list[str]:
        a, b = start.get(name), end.get(name)
        if name == "server":  # snapshots written before a key was known to be volatile still compare equal
            a, b = stable_server(a), stable_server(b)
        if a == b:
            return []
        if name == "packages" and isinstance(a, list) and isinstance(b, list):
            gone, new = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            return [f"packages: removed {gone}, added {new}"]
        if isinstance(a, dict) and isinstance(b, dict):
            keys = sorted(set(a) | set(b))
            return [f"{name}.{k}: {a.get(k)!r} -> {b.get(k)!r}"[:500] for k in keys if a.get(k) != b.get(k)]
        return [f"{name}: changed"]

    protocol = [d for s in PROTOCOL_SECTIONS for d in diff_section(s)]
    warnings = [d for s in WARNING_SECTIONS for d in diff_section(s)]
    return protocol, warnings
