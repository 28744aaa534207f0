"""Acceptance by draft position, request- and token-weighted, by context length (harness/acceptance.py), and the
baseline check of `evalpipe run --save-accept-baseline` / `evalpipe compare --accept-baseline --accept-rtol`.

The definitions are checked on records drawn at random against a direct count; then real servers: a baseline saved
on `--drafter layerskip:4` accepts a fresh boot of the same settings and flags `layerskip:2` (exit 4)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from evalpipe.harness.acceptance import check_baseline, profile, read_baseline
from tests.support.core_helpers import load_run, only_run_dir, run_cli, run_lane
from tests.support.records import as_record
from tests.support.server_harness import ServerProcess


def fake_record(rng: random.Random, g: int) -> dict:
    hist = [rng.randint(0, 5) for _ in range(g + 1)]
    steps = sum(hist)
    tokens = sum(i * h for i, h in enumerate(hist)) + steps  # accepted drafts + one bonus per step
    return {
        "spec": {"accept_histogram": hist, "verify_steps": steps, "accept_length": tokens / steps if steps else None},
        "usage": {"prompt_tokens": rng.choice([10, 300, 2000, 5000]), "completion_tokens": tokens},
        "completion_tokens": tokens,
    }


def sglang_record(rng: random.Random, g: int, key: str) -> dict:
    """A record as SGLang's meta_info gives it: a draft histogram under one of its two names, no verify count."""
    hist = [rng.randint(0, 5) for _ in range(g + 1)]
    hist[rng.randrange(g + 1)] += 1  # at least one verify step
    tokens = sum(i * h for i, h in enumerate(hist)) + sum(hist)
    return {"spec": {key: hist}, "usage": {"prompt_tokens": 100, "completion_tokens": tokens}}


@pytest.mark.parametrize("key", ["spec_accept_histogram", "spec_correct_drafts_histogram", "accept_histogram"])
def test_acceptance_and_compare_read_the_same_token_weighted_accept_length(key):
    """One definition (metrics.token_weighted_accept_length) behind acceptance.json and compare.json's spec block:
    on SGLang-shaped records they agree with each other and with a direct count, under every histogram name."""
    from evalpipe.compare.analysis import spec_stats

    rng = random.Random(11)
    for _ in range(10):
        recs = [sglang_record(rng, rng.randint(1, 5), key) for _ in range(rng.randint(1, 8))]
        direct = sum(r["usage"]["completion_tokens"] for r in recs) / sum(sum(r["spec"][key]) for r in recs)
        typed = [as_record(r) for r in recs]
        assert profile(typed)["token_weighted_accept_length"] == pytest.approx(direct)
        assert spec_stats(typed)["accept_length_token_weighted"] == pytest.approx(direct)
        assert spec_stats(typed)["histogram_basis"] == "per-step accept lengths"


def test_profile_matches_a_direct_count_on_random_records():
    rng = random.Random(5)
    for _ in range(20):
        g = rng.randint(1, 6)
        recs = [r for r in (fake_record(rng, g) for _ in range(rng.randint(2, 12))) if r["spec"]["verify_steps"]]
        got = profile([as_record(r) for r in recs])
        steps = sum(r["spec"]["verify_steps"] for r in recs)
        for j in range(1, g + 1):  # accepted at least j drafts, over all steps
            want = sum(1 for r in recs for i, h in enumerate(r["spec"]["accept_histogram"]) for _ in range(h) if i >= j)
            assert got["per_position"][j - 1] == pytest.approx(want / steps)
        assert all(a >= b for a, b in zip(got["per_position"], got["per_position"][1:]))
        assert got["token_weighted_accept_length"] == pytest.approx(
            sum(r["usage"]["completion_tokens"] for r in recs) / steps
        )
        assert got["request_weighted_accept_length"] == pytest.approx(
            sum(r["spec"]["accept_length"] for r in recs) / len(recs)
        )
        assert sum(b["responses"] for b in got["by_context_tokens"].values()) == len(recs)
        assert set(got["by_context_tokens"]) <= {"0-256", "256-1024", "1024-4096", "4096-16384"}


def test_profile_edge_cases_and_baseline_check():
    assert profile([]) is None and profile([as_record({"spec": None})]) is None
    assert profile([as_record({"spec": {"accept_histogram": [0, 0, 0]}})]) is None  # no verify step
    vllm = profile([], {"acceptance_per_position": [0.8, 0.5], "mean_accept_length": 2.3})
    assert vllm["source"] == "metrics (run-level)" and vllm["per_position"] == [0.8, 0.5]
    base = {"per_position": [0.8, 0.5], "token_weighted_accept_length": 2.3}
    assert not check_baseline({"per_position": [0.77, 0.48], "token_weighted_accept_length": 2.2}, base, 0.05)[
        "regressed"
    ]
    low = check_baseline({"per_position": [0.8, 0.47], "token_weighted_accept_length": 2.3}, base, 0.05)
    assert low["regressed"] and "[2]" in low["reason"]
    assert check_baseline({"per_position": [0.9], "token_weighted_accept_length": 2.5}, base, 0.05)["regressed"]
    assert check_baseline(None, base, 0.05)["regressed"]


def test_bad_baseline_files_are_usage_errors(tmp_path):
    bad = tmp_path / "bad.json"
    for text in (
        "not json",
        json.dumps({"schema": "other"}),
        json.dumps({"schema": "evalpipe-accept-baseline/1", "per_position": []}),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError):
            read_baseline(bad)
    proc = run_cli("compare", tmp_path, tmp_path, "--accept-baseline", bad)
    assert proc.returncode == 2 and "per_position" in proc.stderr


# The drafters' acceptance differs from the first tokens, but at 32 tokens layerskip:4 accepted every draft and
# layerskip:2's drop showed at positions 3-5 only; at 64 it shows at position 1, which the test checks.
ARITH_ARGS = ("--num-examples", "8", "--max-tokens", "64")


def spec_server(drafter: str) -> ServerProcess:
    return ServerProcess("--speculative", "block", "--drafter", drafter, model="evalpipe-skills-dsv4")


@pytest.fixture(scope="module")
def layerskip4():
    """One `--drafter layerskip:4` server (the default drafter) for the baseline's first run and the context buckets."""
    server = spec_server("layerskip:4")
    yield server
    server.stop()


def arith_run(server: ServerProcess, out: Path, arm: str, *extra: str) -> Path:
    proc = run_lane("arith", server.base + "/v1", out, "--arm", arm, *ARITH_ARGS, *extra, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(out, "arith")


def fresh_arith_run(drafter: str, out: Path, arm: str) -> Path:
    server = spec_server(drafter)
    try:
        return arith_run(server, out, arm)
    finally:
        server.stop()


def test_baseline_accepts_a_fresh_boot_and_flags_a_weaker_drafter(layerskip4, tmp_path):
    baseline = tmp_path / "layerskip4.json"
    first = arith_run(layerskip4, tmp_path / "a", "ls4", "--save-accept-baseline", str(baseline))
    saved = json.loads(baseline.read_text())
    summary = json.loads((first / "summary.json").read_text())
    assert saved["per_position"] == summary["acceptance"]["per_position"] and len(saved["per_position"]) == 5
    assert saved["server_speculative"]["drafter"] == "layerskip:4"
    fresh = fresh_arith_run("layerskip:4", tmp_path / "b", "ls4b")
    ok = run_cli("compare", first, fresh, "--out", tmp_path / "c1", "--accept-baseline", baseline)
    assert ok.returncode == 0, ok.stderr
    assert "id='accept-baseline'" in (tmp_path / "c1" / "report.html").read_text()
    check = json.loads((tmp_path / "c1" / "compare.json").read_text())["accept_baseline"]
    assert not check["regressed"] and all(r["relative_change"] == 0 for r in check["positions"])
    weak = fresh_arith_run("layerskip:2", tmp_path / "d", "ls2")
    bad = run_cli("compare", first, weak, "--no-html", "--out", tmp_path / "c2", "--accept-baseline", baseline)
    assert bad.returncode == 4 and "ACCEPTANCE REGRESSION" in bad.stderr, bad.stdout + bad.stderr
    result = json.loads((tmp_path / "c2" / "compare.json").read_text())
    assert result["accept_baseline"]["positions"][0]["regressed"]
    a, b = result["acceptance"]["a"], result["acceptance"]["b"]
    assert b["token_weighted_accept_length"] < a["token_weighted_accept_length"]
    assert a["request_weighted_accept_length"] is not None and a["by_context_tokens"]


def test_context_buckets_on_a_real_run_with_prompts_of_several_lengths(layerskip4, tmp_path):
    """`evalpipe run retrieval` (its first three prompts are ~180, ~470 and ~1,800 bytes, a byte a token) on the
    default model with block speculation: the summary's buckets hold the responses of their prompt lengths, and
    each bucket's rates and accept lengths are a direct count over its own records."""
    proc = run_lane("retrieval", layerskip4.base + "/v1", tmp_path / "r", "--num-examples", "3", timeout=300)
    assert proc.returncode == 0, proc.stderr
    records, summary, _ = load_run(only_run_dir(tmp_path / "r", "retrieval"))
    buckets = summary["acceptance"]["by_context_tokens"]
    prompt_tokens = sorted(r["usage"]["prompt_tokens"] for r in records)
    assert prompt_tokens[0] < 256 <= prompt_tokens[1] < 1024 <= prompt_tokens[2]  # three lengths, three buckets
    assert {k: v["responses"] for k, v in buckets.items()} == {"0-256": 1, "256-1024": 1, "1024-4096": 1}
    for name, lower, upper in (("0-256", 0, 256), ("256-1024", 256, 1024), ("1024-4096", 1024, 4096)):
        mine = [r for r in records if lower <= r["usage"]["prompt_tokens"] < upper]
        hists = [r["spec"]["accept_histogram"] for r in mine]
        steps = sum(map(sum, hists))
        assert buckets[name]["verify_steps"] == steps == sum(r["spec"]["verify_steps"] for r in mine)
        for j, rate in enumerate(buckets[name]["per_position"], start=1):
            assert rate == pytest.approx(sum(h for hist in hists for h in hist[j:]) / steps)
        assert buckets[name]["token_weighted_accept_length"] == pytest.approx(
            sum(r["usage"]["completion_tokens"] for r in mine) / steps
        )
        assert buckets[name]["request_weighted_accept_length"] == pytest.approx(
            sum(r["spec"]["accept_length"] for r in mine) / len(mine)
        )


# SGLang's per-response speculative fields, as its tokenizer manager fills `meta_info` (`fill_spec_decoding_meta`
# in sgl-project/sglang, python/sglang/srt/managers): spec_verify_ct, spec_accept_length (completion tokens /
# verify steps, bonus included), spec_accept_rate, spec_num_correct_drafts and spec_num_proposed_drafts, and
# spec_correct_drafts_histogram (steps that accepted exactly i drafts), still sent under its older name
# spec_accept_histogram as a backward-compatible alias that SGLang marks for removal.
@pytest.mark.parametrize("histogram_key", ["spec_correct_drafts_histogram", "spec_accept_histogram"])
def test_sglang_meta_info_is_a_per_response_source(tmp_path, histogram_key):
    from tests.support.scripted_server import scripted_server

    rng = random.Random()
    hist = [rng.randint(0, 9) for _ in range(4)]  # G = 3 (a topk-1 EAGLE chain of 3 steps)
    steps = sum(hist)
    meta = {
        "spec_verify_ct": steps,
        "spec_accept_length": rng.uniform(1.0, 4.0),
        "spec_accept_rate": 0.5,
        "spec_num_correct_drafts": sum(i * h for i, h in enumerate(hist)),
        "spec_num_proposed_drafts": 3 * steps,
        histogram_key: hist,
    }
    with scripted_server(mode="skills", meta_info=meta) as base_url:
        proc = run_lane("retrieval", base_url, tmp_path / "r", "--num-examples", "4", timeout=120)
    assert proc.returncode == 0, proc.stderr
    records, summary, _ = load_run(only_run_dir(tmp_path / "r", "retrieval"))
    got = summary["acceptance"]
    assert got["source"] == "responses" and got["responses"] == 4 and got["verify_steps"] == 4 * steps
    for j, rate in enumerate(got["per_position"], start=1):
        assert rate == pytest.approx(sum(hist[j:]) / steps)
    assert got["request_weighted_accept_length"] == pytest.approx(meta["spec_accept_length"])
    assert got["token_weighted_accept_length"] == pytest.approx(
        sum(r["usage"]["completion_tokens"] for r in records) / (4 * steps)
    )
    assert set(got["by_context_tokens"]) == {"0-256", "256-1024", "1024-4096"}
