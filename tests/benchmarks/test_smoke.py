"""Every benchmark script still runs: `python -m benchmarks.<folder>.<script> --smoke` on the CPU exits 0 and prints
a table. The scripts are found by listing benchmarks/'s folders, so a new one is checked without being listed here;
this file checks kernels/, engine/ and harness/, test_smoke_model.py model/, test_smoke_serving.py serving/."""

from __future__ import annotations

import pytest

from tests.support.benchmark_smoke import FOLDERS, REPO, SCRIPTS, check_smoke, scripts_in, table_rows

HERE = ("kernels", "engine", "harness")
ELSEWHERE = ("model", "serving")  # test_smoke_model.py, test_smoke_serving.py


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
    assert {s.split("/")[0] for s in SCRIPTS} <= set(FOLDERS) == set(HERE + ELSEWHERE)  # each folder is checked
    assert not [p.name for p in (REPO / "benchmarks").glob("*/*.py") if "sys.path" in p.read_text()]


@pytest.mark.parametrize("script", scripts_in(*HERE))
def test_smoke(script, tmp_path):
    check_smoke(script, tmp_path)
