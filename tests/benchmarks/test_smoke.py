"""Every benchmark script still runs: `python -m benchmarks.<folder>.<script> --smoke` on the CPU exits 0 and prints
a table. The scripts are found by listing benchmarks/'s folders, so a new one is checked without being listed here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("kernels", "engine", "serving", "harness", "model")
SCRIPTS = sorted(
    p.relative_to(REPO / "benchmarks").as_posix()
    for p in (REPO / "benchmarks").glob("*/*.py")
    if p.name != "__init__.py"
)


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


def test_table_rows_finds_tables_and_only_tables():
    assert table_rows("| a | b | c |\n|---|---|---|\n| 1 | 2 | 3 |\n") == 3
    assert table_rows("| quantity | value |\n|---|---|\n| failures | none |\n") == 3
    assert table_rows("name    batch   tok/s\nrunner      1    12.5\n") == 2
    assert table_rows("shape   old us  config\nE8 T=1  13.4    gemv | gemv\n") == 2
    assert table_rows("  ok   T=1 hc_mix vs reference: max abs 3.7e-09\n  ok   T=6 chain run twice: max abs 0\n") == 0
    assert table_rows("RESULT: all checks passed\nsite calls: {'a': 1}\n") == 0
    assert table_rows("") == 0


def test_every_script_sits_in_a_question_folder():
    assert SCRIPTS, "no benchmark scripts found"
    assert {s.split("/")[0] for s in SCRIPTS} <= set(FOLDERS)
    assert not [p.name for p in (REPO / "benchmarks").glob("*/*.py") if "sys.path" in p.read_text()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_smoke(script, tmp_path):
    module = "benchmarks." + script[: -len(".py")].replace("/", ".")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OUT": str(tmp_path),
    }
    env.pop("TRITON_INTERPRET", None)  # a script's CPU path sets it itself, before triton loads
    proc = subprocess.run(
        [sys.executable, "-m", module, "--smoke"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    tail = (proc.stdout[-3000:] + "\n" + proc.stderr[-3000:]).strip()
    assert proc.returncode == 0, f"{module} --smoke exited {proc.returncode}:\n{tail}"
    assert table_rows(proc.stdout) >= 2, f"{module} --smoke printed no table:\n{tail}"
