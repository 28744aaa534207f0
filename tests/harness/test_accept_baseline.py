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
from tests.support.core_helpers import only_run_dir, run_cli, run_lane
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


def test_profile_matches_a_direct_count_on_random_records():
    rng = random.Random(5)
    for _ in range(20):
        g = rng.randint(1, 6)
        recs = [r for r in (fake_record(rng, g) for _ in range(rng.randint(2, 12))) if r["spec"]["verify_steps"]]
        got = profile(recs)
        steps = sum(r["spec"]["verify_steps"] for r in recs)
        for j in range(1, g + 1):  # accepted at least j drafts, over all steps
            want = sum(1 for r in recs for i, h in enumerate(r["spec"]["accept_histogram"]) for _ in range(h) if i >= j)
            assert got["per_position"][j - 1] == pytest.approx(want / steps)
        assert all(a >= b for a, b in zip(got["per_position"], got["per_position"][1:]))
        assert got["token_weighted_accept_length"] == pytest.approx(
            sum(r["usage"]["completion_tokens"] for r in recs) / steps)
        assert got["request_weighted_accept_length"] == pytest.approx(
            sum(r["spec"]["accept_length"] for r in recs) / len(recs))
        assert sum(b["responses"] for b in got["by_context_tokens"].values()) == len(recs)
        assert set(got["by_context_tokens"]) <= {"0-256", "256-1024", "1024-4096", "4096-16384"}


def test_profile_edge_cases_and_baseline_check():
    assert profile([]) is None and profile([{"spec": None}]) is None
    assert profile([{"spec": {"accept_histogram": [0, 0, 0]}}]) is None  # no verify step
    vllm = profile([], {"acceptance_per_position": [0.8, 0.5], "mean_accept_length": 2.3})
    assert vllm["source"] == "metrics (run-level)" and vllm["per_position"] == [0.8, 0.5]
    base = {"per_position": [0.8, 0.5], "token_weighted_accept_length": 2.3}
    assert not check_baseline({"per_position": [0.77, 0.48], "token_weighted_accept_length": 2.2}, base, 0.05)[
        "regressed"]
    low = check_baseline({"per_position": [0.8, 0.47], "token_weighted_accept_length": 2.3}, base, 0.05)
    assert low["regressed"] and "[2]" in low["reason"]
    assert check_baseline({"per_position": [0.9], "token_weighted_accept_length": 2.5}, base, 0.05)["regressed"]
    assert check_baseline(None, base, 0.05)["regressed"]


def test_bad_baseline_files_are_usage_errors(tmp_path):
    bad = tmp_path / "bad.json"
    for text in ("not json", json.dumps({"schema": "other"}),
                 json.dumps({"schema": "evalpipe-accept-baseline/1", "per_position": []})):
        bad.write_text(text)
        with pytest.raises(ValueError):
            read_baseline(bad)
    proc = run_cli("compare", tmp_path, tmp_path, "--accept-baseline", bad)
    assert proc.returncode == 2 and "per_position" in proc.stderr


def arith_run(drafter: str, out: Path, arm: str, *extra: str) -> Path:
    server = ServerProcess("--speculative", "block", "--drafter", drafter, model="evalpipe-skills-dsv4")
    try:
        proc = run_lane("arith", server.base + "/v1", out, "--arm", arm, "--num-examples", "8", *extra, timeout=300)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(out, "arith")


def test_baseline_accepts_a_fresh_boot_and_flags_a_weaker_drafter(tmp_path):
    baseline = tmp_path / "layerskip4.json"
    first = arith_run("layerskip:4", tmp_path / "a", "ls4", "--save-accept-baseline", str(baseline))
    saved = json.loads(baseline.read_text())
    summary = json.loads((first / "summary.json").read_text())
    assert saved["per_position"] == summary["acceptance"]["per_position"] and len(saved["per_position"]) == 5
    assert saved["server_speculative"]["drafter"] == "layerskip:4"
    fresh = arith_run("layerskip:4", tmp_path / "b", "ls4b")
    ok = run_cli("compare", first, fresh, "--out", tmp_path / "c1", "--accept-baseline", baseline)
    assert ok.returncode == 0, ok.stderr
    assert "id='accept-baseline'" in (tmp_path / "c1" / "report.html").read_text()
    check = json.loads((tmp_path / "c1" / "compare.json").read_text())["accept_baseline"]
    assert not check["regressed"] and all(r["relative_change"] == 0 for r in check["positions"])
    weak = arith_run("layerskip:2", tmp_path / "d", "ls2")
    bad = run_cli("compare", first, weak, "--no-html", "--out", tmp_path / "c2", "--accept-baseline", baseline)
    assert bad.returncode == 4 and "ACCEPTANCE REGRESSION" in bad.stderr, bad.stdout + bad.stderr
    result = json.loads((tmp_path / "c2" / "compare.json").read_text())
    assert result["accept_baseline"]["positions"][0]["regressed"]
    a, b = result["acceptance"]["a"], result["acceptance"]["b"]
    assert b["token_weighted_accept_length"] < a["token_weighted_accept_length"]
    assert a["request_weighted_accept_length"] is not None and a["by_context_tokens"]
