"""An engine build held back until a file exists (the engine process is spawned, so the gate must cross processes):
lets a test see the server's "loading" answers before the model is ready."""

from __future__ import annotations

import os
import time

from evalpipe.engine.build import build

GATE_ENV = "EVALPIPE_TEST_BUILD_GATE"


def build_after_gate(settings):
    gate = os.environ[GATE_ENV]
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
    return build(settings)
