"""What `.ci/run` is still installing while the tests run. It starts the suite as soon as the project environment is
ready and finishes the vLLM and lm-eval environments, the real model and Chromium in the background: each has a file
results/pending/NAME from before its install starts until it ends, either way. A test that needs one waits for that
file to go, then checks for the thing itself as it always does (absent under CI: a failure, not a skip)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

PENDING = Path(__file__).resolve().parents[2] / "results" / "pending"
WAIT_S = 1200  # the longest install (vLLM's environment) took 157 s from the start of a clean-clone CI run


def wait_for(name: str) -> None:
    """Return once results/pending/NAME is gone (at once where .ci/run did not start that install)."""
    marker = PENDING / name
    deadline = time.monotonic() + WAIT_S
    while marker.exists():
        if time.monotonic() > deadline:
            pytest.fail(f"{name} was still installing after {WAIT_S} s ({marker} is there; see results/{name}.log)")
        time.sleep(1)
