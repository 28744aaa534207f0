"""Every benchmark script's `python -m benchmarks.<folder>.<script> --smoke`, run as CI runs it: the scripts are
found by listing benchmarks/'s folders, and tests/benchmarks/test_smoke*.py each check some folders' scripts (files,
not one file, so that pyproject's `--dist loadfile` shares the smoke runs between the two xdist workers)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.support.cli_fork_server import run_forked

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("kernels", "engine", "serving", "harness", "model")
SCRIPTS = sorted(
    p.relative_to(REPO / "benchmarks").as_posix()
    for p in (REPO / "benchmarks").glob("*/*.py")
    if p.name != "__init__.py"
)


def scripts_in(*folders: str) -> list[str]:
    """The scripts of these folders, as `folder/script.py`."""
    return [s for s in SCRIPTS if s.split("/")[0] in folders]


def table_rows(text: str) -> int:
    """The longest run of consecutive table rows: a markdown row (starts with `|`, at least 2 cells; its `|---|` rule
    counts) or an aligned row (at least 3 cells separated by runs of 2 or more spaces)."""
    best = run = 0
    for line in text.splitlines():
        line = line.strip()
        markdown = line.startswith("|")
        cells = [c for c in (line.strip("|").split("|") if markdown else re.split(r"\s{2,}", line)) if c.strip()]
        run = run + 1 if len(cells) >= (2 if markdown else 3) else 0
        best = max(best, run)
    return best


def check_smoke(script: str, tmp_path: Path) -> None:
    """`--smoke` of `folder/script.py` in a child process (OUT and the working folder: tmp_path) exits 0 and prints a
    table. The child is run by tests/support/cli_fork_server.run_forked (forked from its `torch` server: about 3 s of
    CPU a run saved)."""
    module = "benchmarks." + script[: -len(".py")].replace("/", ".")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OUT": str(tmp_path),
        # one torch thread, as the servers the tests start run (`serve --threads`, default 1): beside the other
        # xdist worker on the 2-core machine a second thread spins against it (beside one busy process:
        # training_step --smoke 13.0 s with torch's default of 2 threads, 9.1 s with one; prefill_invariance_gpu
        # 10.4-11.3 s, 6.8-7.4 s)
        "OMP_NUM_THREADS": "1",
    }
    env.pop("TRITON_INTERPRET", None)  # a script's CPU path sets it itself, before triton loads
    proc = run_forked(["--smoke"], module=module, env=env, cwd=str(tmp_path), timeout=600)
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, f"{module} --smoke exited {proc.returncode}:\n{tail}"
    assert table_rows(proc.stdout) >= 2, f"{module} --smoke printed no table:\n{tail}"
