"""`evalpipe qualify` against a stock vLLM (CPU build, no dev mode: no /server_info, no /reset_prefix_cache) that
`evalpipe serve --engine vllm` started, with nothing to look up: boundary sizes from its /metrics
(`vllm:cache_config_info` block size) and from the launch receipt (the `--max-num-batched-tokens` of its argv, found
in results/receipts/ by the server's address), boundaries and mixed on a cold cache without a flush, and kv-pressure
on a 2,048-token pool (16 blocks of 128) that the gate overfills. One boot for the module (~1 min on 2 cores).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from evalpipe.launchers.base import free_port
from tests.support.vllm_peer import BOOT_TIMEOUT_S, PASSTHROUGH, evalpipe, make_model, require_vllm

BLOCKS, BLOCK_SIZE, CHUNK = 16, 128, 512


@pytest.fixture(scope="module")
def stock_vllm(tmp_path_factory):
    """(base URL with /v1, the folder serve ran in) of a vLLM without dev mode and with a 16-block KV pool."""
    python = require_vllm()
    root = tmp_path_factory.mktemp("stock-vllm")
    model = make_model(root / "tiny-llama")
    port = free_port()
    err = open(root / "serve.err", "w")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evalpipe.cli",
            "serve",
            "--engine",
            "vllm",
            "--engine-python",
            python,
            "--dtype",
            "float32",
            "--set-env",
            "VLLM_ENABLE_V1_MULTIPROCESSING=0",  # one process fewer to import vLLM in (tests/support/vllm_peer.py)
            "--model",
            str(model),
            "--port",
            str(port),
            "--ready-timeout",
            str(BOOT_TIMEOUT_S),
            "--",
            *PASSTHROUGH,
            "--max-model-len",
            "1024",
            "--num-gpu-blocks-override",
            str(BLOCKS),
            "--max-num-batched-tokens",
            str(CHUNK),
        ],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
        cwd=root,  # the receipt goes to root/results/receipts/, where qualify run in root finds it
    )
    try:
        line = proc.stdout.readline()
        if not line.startswith("ready: "):
            proc.wait(timeout=60)
            pytest.fail(f"evalpipe serve --engine vllm did not start:\n{(root / 'serve.err').read_text()[-4000:]}")
        yield f"http://127.0.0.1:{port}/v1", root
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            proc.kill()
            err.close()


def test_boundaries_mixed_and_kv_pressure_pass_on_stock_vllm_with_nothing_to_look_up(stock_vllm):
    base_url, root = stock_vllm
    result = evalpipe(
        "qualify",
        "--base-url",
        base_url,
        "--gates",
        "boundaries,mixed,kv-pressure",
        "--max-tokens",
        "8",
        "--concurrency",
        "4",  # mixed's short decodes and kv-pressure's concurrent round: enough to overlap, fewer to wait for
        "--out",
        str(root / "q"),
        cwd=root,
    )
    qualified = json.loads((root / "q" / "qualify.json").read_text())
    by = {g["gate"]: g for g in qualified["gates"]}
    assert result.returncode == 0, {name: g["reason"] for name, g in by.items()}
    sizes = qualified["endpoint"]["sizes"]
    (receipt,) = (root / "results" / "receipts").glob("vllm-*.json")
    assert sizes["receipt"] == str(receipt.relative_to(root))
    assert sizes["sources"] == {
        "page": "/metrics vllm:cache_config_info",
        "pool_tokens": "/metrics vllm:cache_config_info",
        "chunk": "receipt argv",
    }
    boundaries = by["boundaries"]["notes"]
    assert boundaries["sizes"] == {"chunk": [CHUNK], "page": [BLOCK_SIZE]}
    assert boundaries["lengths"] == [127, 128, 129, 511, 512, 513]
    assert boundaries["flush_route"] is None and boundaries["prompts"] == "token ids from /tokenize"
    for gate in ("boundaries", "mixed"):  # every solo run was cold, as vLLM itself reports (prompt tokens details)
        solos = [r for r in by[gate]["records"] if r["kind"].endswith("solo")]
        assert solos and all(r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 for r in solos)
        assert any(c["name"] == "cold cache" for r in solos for c in r["checks"])
    # the run together read what the solo runs cached (the pages of its own prompt): the cache was exercised
    together = [r for r in by["boundaries"]["records"] if r["kind"] == "boundaries-together"]
    assert any(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in together)
    kv = by["kv-pressure"]["notes"]
    assert kv["pool_tokens"] == BLOCKS * BLOCK_SIZE and kv["serial_tokens"] >= 1.2 * kv["pool_tokens"]
    assert kv["reuse_cached_tokens"] > 0 and kv["cold_cache"].endswith("no flush route")
