"""benchmarks/model/'s scripts still run: `--smoke` exits 0 and prints a table (test_smoke.py checks the other
folders)."""

from __future__ import annotations

import pytest

from tests.support.benchmark_smoke import check_smoke, scripts_in


@pytest.mark.parametrize("script", scripts_in("model"))
def test_smoke(script, tmp_path):
    check_smoke(script, tmp_path)
