"""Helpers for the evaluation-core tests: run the real `evalpipe` CLI as a subprocess and read run folders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.cli_fork_server import run_forked

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("EVALPIPE_DATA_DIR") or REPO.parent / "shared" / "data")


def evalpipe_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "evalpipe.cli", *map(str, args)]


# A child inherits its parent's SIGINT disposition and mask, and Python keeps an inherited "ignore": were a test
# worker ever to run with SIGINT ignored or blocked, a child it interrupts would never see the signal, and the test
# would measure the worker, not evalpipe. This prelude gives the child Python's own handler, as under a terminal.
_INTERRUPTIBLE = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); sys.argv[0] = 'evalpipe'; "
    "runpy.run_module('evalpipe.cli', run_name='__main__', alter_sys=True)"
)


def interruptible_evalpipe_cmd(*args: str) -> list[str]:
    """`evalpipe ARGS` for a test that sends the child SIGINT (Ctrl-C)."""
    return [sys.executable, "-c", _INTERRUPTIBLE, *map(str, args)]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`evalpipe ARGS` in a child process (data dir pinned to the shared copy), run by
    tests/support/cli_fork_server.run_forked."""
    env = dict(os.environ, EVALPIPE_DATA_DIR=str(DATA_DIR))
    return run_forked(list(map(str, args)), env=env, cwd=str(REPO), timeout=timeout)


def run_lane(lane: str, base_url: str, out: Path, *extra: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_cli(
        "run",
        lane,
        "--base-url",
        base_url,
        "--out",
        out,
        "--no-progress",
        "--retry-backoff",
        "0.01",
        *extra,
        timeout=timeout,
    )


def run_sampling_gate(base_url: str, out: Path, tokens: int, seed: int) -> tuple[subprocess.CompletedProcess, dict]:
    """`evalpipe qualify --gates sampling` against `base_url` (the `/v1` root) with this token budget and seed, in a
    child process: (the process, the gate's entry of OUT/qualify.json)."""
    proc = run_cli(
        "qualify",
        "--base-url",
        base_url,
        "--gates",
        "sampling",
        "--sampling-tokens",
        str(tokens),
        "--sampling-seed",
        str(seed),
        "--out",
        out,
        "--no-progress",
        timeout=300,
    )
    return proc, json.loads((Path(out) / "qualify.json").read_text())["gates"][0]


def only_run_dir(out: Path, lane: str) -> Path:
    dirs = sorted((out / lane).iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def load_run(run_dir: Path) -> tuple[list[dict], dict, dict]:
    """(records, summary, manifest); every line of responses.jsonl must parse."""
    lines = (run_dir / "responses.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    summary = json.loads((run_dir / "summary.json").read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return records, summary, manifest
