"""Run the Triton kernels of `evalpipe.kernels` in Triton's CPU interpreter for the tests in this directory only.

`triton.jit` decides interpreter-or-compiler when a kernel module is imported, so TRITON_INTERPRET=1 must be set
before the test modules here import the kernels (this conftest is imported first). Kernel modules that another
test directory imported earlier are reloaded so their kernels become interpretable. After collection the variable
is put back to its previous value, so servers and subprocesses started by other areas' tests never inherit it;
an autouse fixture sets it again around each test in this directory (the dispatcher reads it at call time).
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

_PREVIOUS = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"

for _name in [m for m in sys.modules if m.startswith("evalpipe.kernels.") and not m.endswith("._backend")]:
    importlib.reload(sys.modules[_name])


def pytest_collection_finish(session):
    if _PREVIOUS is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _PREVIOUS


@pytest.fixture(autouse=True)
def triton_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
