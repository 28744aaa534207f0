"""The fault matrix's seeded column (docs/serving.md, "Planted faults"): with `evalpipe serve --deterministic` (keyed
sampling, sample-verify) and `evalpipe run --sample-seeds`, a sampled run with speculation on must be the spec-off
run token for token, so a verifier fault that the sampling gate needs about 15 M tokens to see under layerskip:4
(`residual-from-target`, benchmarks/harness/residual_fault_power.py) breaks the replay within a few requests: it acts
only where a draft is rejected, and layerskip:4 drafts with the target's own key, so its drafts are rejected rarely.

Detector: `evalpipe run gsm8k --temperature 1 --sample-seeds 7` (the first QUESTIONS items, MAX_TOKENS each; a lane
the default model was not trained on, so its tokens are uncertain and rejections happen) on each `--deterministic`
server, then `evalpipe compare` against the clean spec-off run; it flags on any differing output and reports the first
differing request (question order) and the token where it diverges. One server at a time, booted and stopped by the
module fixture. `pytest tests/engine/test_fault_matrix_seeded.py -s` prints the column.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.core_helpers import only_run_dir, run_cli, run_lane
from tests.support.server_harness import ServerProcess

MODEL = "evalpipe-skills-dsv4"
BLOCK = ["--deterministic", "--speculative", "block"]
CONFIGS = {  # name -> serve arguments (the default drafter of `--speculative block` is layerskip:4)
    "clean, spec off": ["--deterministic"],
    "clean, spec block": BLOCK,
    "residual-from-target (layerskip:4)": BLOCK + ["--debug-fault", "residual-from-target"],
    "greedy-sampling": BLOCK + ["--debug-fault", "greedy-sampling"],
}
QUESTIONS = 8
MAX_TOKENS = 96
TEMPERATURE = "1"
LANE = "gsm8k"
WITHIN_REQUESTS = 100  # the seeded-replay target: how soon the seeded column must catch residual-from-target


def seeded_run(server: ServerProcess, out: Path) -> Path:
    extra = ["--temperature", TEMPERATURE, "--sample-seeds", "7", "--num-examples", str(QUESTIONS), "--max-tokens"]
    proc = run_lane(LANE, server.base + "/v1", out, "--arm", "seeded", *extra, str(MAX_TOKENS), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(out, LANE)


@pytest.fixture(scope="module")
def column(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("seeded-column")
    runs: dict[str, Path] = {}
    for name, args in CONFIGS.items():
        server = ServerProcess(*args, model=MODEL)
        try:
            runs[name] = seeded_run(server, root / f"run{len(runs)}")
        finally:
            server.stop()
    rows = {}
    for name, run in runs.items():
        if name == "clean, spec off":
            continue
        out = root / f"compare{len(rows)}"
        proc = run_cli("compare", runs["clean, spec off"], run, "--no-html", "--out", out, timeout=300)
        assert proc.returncode == 0, proc.stderr
        result = json.loads((out / "compare.json").read_text())
        differing = [q for q in result["per_question"] if not q["identical"]]
        rows[name] = {
            "flagged": bool(differing),
            "identical": f"{result['agreement']['n_identical']}/{result['agreement']['n_pairs']}",
            "first_request": 1 + result["per_question"].index(differing[0]) if differing else None,
            "diverge_at": differing[0]["divergence_position"] if differing else None,
            "keyed_both": result["deterministic"]["a"] is True and result["deterministic"]["b"] is True,
        }
    detector = f"seeded replay vs clean spec off ({LANE}, T = {TEMPERATURE}, --sample-seeds 7)"
    print(f"\n| server (--deterministic) | {detector} |")
    print("|---|---|")
    for name, row in rows.items():
        where = f", first at request {row['first_request']}, token {row['diverge_at']}" if row["flagged"] else ""
        print(f"| {name} | {'FLAGS' if row['flagged'] else 'passes'}: {row['identical']} identical{where} |")
    return rows


def test_clean_speculation_replays_spec_off_token_for_token(column):
    row = column["clean, spec block"]
    assert not row["flagged"] and row["identical"] == f"{QUESTIONS}/{QUESTIONS}", row
    assert all(r["keyed_both"] for r in column.values()), column  # every arm was served --deterministic


@pytest.mark.parametrize("fault", ["residual-from-target (layerskip:4)", "greedy-sampling"])
def test_a_sampling_fault_breaks_seeded_replay_within_the_first_requests(column, fault):
    row = column[fault]
    assert row["flagged"] and row["first_request"] <= min(WITHIN_REQUESTS, QUESTIONS), row
    assert row["diverge_at"] is not None and row["diverge_at"] < MAX_TOKENS, row
