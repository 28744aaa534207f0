"""`evalpipe run --sample-seeds BASE` against real `evalpipe serve --deterministic` servers (keyed sampling), at
T = 1 on the repeated lane chat-arith-boxed-think-x16: every record's request carries the seed derived from
(BASE, question, repeat); the spec-off arm and a block-speculation arm (the default drafter, layerskip:4; the
n-gram drafter and the planted faults are tests/engine/test_seeded_replay.py's) run with the same BASE give
token-identical outputs, and `evalpipe compare` reports that identity first; another BASE sends other seeds, where
compare computes no agreement. The server reports the seed each sampled choice used (drawn when the request had
none), and replaying it gives the same tokens. The sampling gate (`evalpipe qualify --gates sampling`) passes on
the keyed speculative server."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from evalpipe.harness.sample_seeds import sample_seed
from tests.support.core_helpers import load_run, only_run_dir, run_cli, run_lane, run_sampling_gate
from tests.support.server_harness import ServerProcess

# the window-64 model: its drafts are rejected now and then at T = 1, so the replay is tested across rejections
# (7 of the 45 verify steps of these 8 requests at 32 tokens; the default's layerskip:4 drafts were all accepted in
# them at 64 tokens)
MODEL = "evalpipe-skills-dsv4-w64"
LANE = "chat-arith-boxed-think-x16"
BASE = 46
RUN = ["--num-examples", "4", "--repeats", "2", "--max-tokens", "32", "--concurrency", "8"]
ARMS = {
    "spec_off": [],
    "spec_layerskip": ["--speculative", "block"],
}
# The gate fails a correct sampler with probability at most 3 x ALPHA = 0.003 at any budget (Bonferroni over its
# three tests). At 600 tokens the window-64 model's tokens carry over 300 informative tokens (I = sum of 1 - p_max;
# tests/qualify/test_qualify_sampling.py): a sampler that always took the argmax would score collapse z >= sqrt(I) =
# 17, where ALPHA needs 3.3.
GATE_TOKENS = 600


def lane_run(server: ServerProcess, out: Path, arm: str, base: int) -> Path:
    proc = run_lane(LANE, server.base + "/v1", out, "--arm", arm, "--sample-seeds", str(base), *RUN, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(out, LANE)


def seed_reports(server: ServerProcess) -> dict:
    """A T = 1 chat request without a seed, its replay with the seed the server reported, and a greedy one."""
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none")
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "What is 17 + 25?"}], max_tokens=16)
    first = client.chat.completions.create(temperature=1.0, extra_body={"return_token_ids": True}, **ask)
    seed = first.choices[0].model_extra.get("seed")
    replay = client.chat.completions.create(temperature=1.0, seed=seed, extra_body={"return_token_ids": True}, **ask)
    greedy = client.chat.completions.create(temperature=0.0, **ask)
    return {
        "sampling_noise": httpx.get(server.base + "/get_server_info", timeout=30).json()["sampling_noise"],
        "seed": seed,
        "tokens": first.choices[0].model_extra["token_ids"],
        "replay_seed": replay.choices[0].model_extra.get("seed"),
        "replay_tokens": replay.choices[0].model_extra["token_ids"],
        "greedy_seed": greedy.choices[0].model_extra.get("seed", "absent"),
    }


def sampling_gate(server: ServerProcess, out: Path) -> dict:
    proc, gate = run_sampling_gate(server.base + "/v1", out, GATE_TOKENS, 1)
    return {"exit_code": proc.returncode, "stderr": proc.stderr, **gate["notes"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sample-seeds")
    out: dict = {}
    for arm, args in ARMS.items():
        server = ServerProcess("--deterministic", *args, model=MODEL)
        try:
            out[arm] = lane_run(server, root / arm, arm, BASE)
            if arm == "spec_off":
                out["other_base"] = lane_run(server, root / "other", "spec_off_other", BASE + 1)
                out["seed_reports"] = seed_reports(server)
            if arm == "spec_layerskip":
                out["gate"] = sampling_gate(server, root / "gate")
        finally:
            server.stop()
    return out


def compare(a: Path, b: Path, out: Path) -> dict:
    proc = run_cli("compare", a, b, "--no-html", "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {**json.loads((out / "compare.json").read_text()), "stdout": proc.stdout}


def test_every_record_sends_the_seed_derived_from_base_question_and_repeat(runs):
    records, _, manifest = load_run(runs["spec_off"])
    assert len(records) == 8
    seeds = [r["request"]["seed"] for r in records]
    assert seeds == [sample_seed(BASE, r["question_id"], r["repeat_index"]) for r in records]
    assert len(set(seeds)) == 8
    assert manifest["start"]["lane"]["effective"]["sample_seeds"] == BASE


def test_the_speculation_arm_with_the_same_seeds_is_token_identical_and_compare_says_so_first(runs, tmp_path):
    result = compare(runs["spec_off"], runs["spec_layerskip"], tmp_path)
    assert result["repeated"]
    identity = result["repeated_stats"]["output_identity"]
    assert identity["all_identical"] and identity["n_pairs"] == 8 and identity["basis"] == "token"
    assert result["agreement"]["n_identical"] == 8
    assert "token-identical in all 8 pairs" in result["stdout"]
    records, _, _ = load_run(runs["spec_layerskip"])
    hist = [sum(h) for h in zip(*(r["spec"]["accept_histogram"] for r in records))]
    assert sum(hist[1:]) > 0 and sum(hist[:-1]) > 0, hist  # drafts were accepted and rejected


def test_another_base_sends_other_seeds_and_compare_computes_no_agreement(runs, tmp_path):
    result = compare(runs["spec_off"], runs["other_base"], tmp_path)
    assert "not computed" in result["agreement"]["note"]
    assert "output_identity" not in result["repeated_stats"]
    a, _, _ = load_run(runs["spec_off"])
    b, _, _ = load_run(runs["other_base"])
    assert [r["output_token_ids"] for r in a] != [r["output_token_ids"] for r in b]


def test_the_server_reports_each_sampled_choice_seed_and_it_replays(runs):
    rep = runs["seed_reports"]
    assert rep["sampling_noise"] == "keyed"
    assert isinstance(rep["seed"], int) and 0 <= rep["seed"] < 2**63
    assert rep["replay_seed"] == rep["seed"] and rep["replay_tokens"] == rep["tokens"]
    assert rep["greedy_seed"] in ("absent", None)


def test_sample_seeds_with_seed_is_a_usage_error():
    proc = run_cli("run", LANE, "--sample-seeds", "1", "--seed", "3", "--base-url", "http://127.0.0.1:9/v1")
    assert proc.returncode == 2 and "--sample-seeds sets every request's seed; drop --seed" in proc.stderr
    proc = run_cli("run", LANE, "--sample-seeds", "-1")
    assert proc.returncode == 2 and "--sample-seeds" in proc.stderr


def test_the_sampling_gate_passes_on_the_keyed_speculative_server(runs):
    gate = runs["gate"]
    assert gate["exit_code"] == 0, gate["stderr"]
    assert gate["tokens"] >= GATE_TOKENS and gate["informative_tokens"] > 300
    assert min(gate["chi2_p"], gate["collapse_p"], gate["repeat_p"]) > 0.001
