"""Run the Triton kernels of `evalpipe.kernels` in Triton's CPU interpreter for the tests in this directory only.

Every kernel is jitted on first use per interpreter mode (`kernels._backend.jit`), and the dispatcher reads
TRITON_INTERPRET at call time, so an autouse fixture sets it around each test here; servers and subprocesses started
by other areas' tests never inherit it.
"""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
