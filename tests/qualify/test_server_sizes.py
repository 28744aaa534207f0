"""Sizes from a launch receipt's argv, as the launchers write it (their dry runs: the argv a receipt records), for each
engine's own flag names; the server's report wins over the receipt, and a flag-less receipt gives nothing."""

from __future__ import annotations

import json

from click.testing import CliRunner

from evalpipe.commands.serve import command as launch_command
from evalpipe.qualify import server_sizes


def dry_receipt(*args: str) -> dict:
    result = CliRunner().invoke(launch_command, ["--dry-run", "--json", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_receipt_argv_sizes_per_engine(tmp_path):
    sglang = dry_receipt(
        "--engine", "sglang", "--model", "M", "--", "--page-size", "32", "--chunked-prefill-size=1024",
        "--max-total-tokens", "9000",
    )  # fmt: skip
    sizes = server_sizes.gather(None, None, sglang)
    assert (sizes["page"], sizes["chunk"], sizes["pool_tokens"]) == ([32], [1024], 9000)
    assert set(sizes["sources"].values()) == {"receipt argv"}
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"sliding_window": 4096}))
    vllm = dry_receipt(
        "--engine", "vllm", "--model", str(model), "--engine-python", "/x/python", "--",
        "--block-size", "16", "--num-gpu-blocks-override", "100", "--max-num-batched-tokens", "2048",
    )  # fmt: skip
    vllm["options"] = {"model": str(model)}  # what a receipt records beside the argv (the launcher's options)
    sizes = server_sizes.gather(None, None, vllm)
    assert (sizes["page"], sizes["chunk"], sizes["window"], sizes["pool_tokens"]) == ([16], [2048], [4096], 1600)
    assert sizes["sources"]["window"] == "receipt model config"
    # what the server itself reports wins; vLLM's /metrics labels come before the receipt
    sizes = server_sizes.gather({"page_size": 64}, {"block_size": "128", "kv_cache_size_tokens": "5120"}, vllm)
    assert (sizes["page"], sizes["pool_tokens"]) == ([64], 5120)
    assert sizes["sources"]["page"] == "server info" and sizes["sources"]["pool_tokens"].startswith("/metrics")
    plain = server_sizes.gather(None, None, dry_receipt("--engine", "vllm", "--model", "M", "--engine-python", "/x"))
    assert plain == {"sources": {}, "pool_tokens": None}
