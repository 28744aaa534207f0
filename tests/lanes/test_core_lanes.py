"""Lanes, pins and graders: the protocol facts the issue fixes, checked against the real data files."""

from __future__ import annotations

import hashlib
import json

import pytest

from evalpipe.harness.summary import compute_summary
from evalpipe.lanes import computed_pins, get_lane, load_pins
from evalpipe.lanes.grading import INVALID, GraderPool, extract_boxed, legacy_answer_value
from tests.support.core_helpers import DATA_DIR, run_cli
from tests.support.records import as_record

GSM8K_SHA = "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
PREFIX_SHA = "8d2a7823e8b2157917ae88db830fedc5e2a984e5ecabf4ae39380756d23f48b2"
AIME26_SHA = "6a43e48d55eb7736003f53074fef041a3da2b78d902d3fcd0b1974b2523221fc"


def test_gsm8k_lane_matches_issue_hashes_and_pins():
    lane = get_lane("gsm8k")
    data = lane.load(DATA_DIR, allow_data_drift=False)
    assert data.dataset_sha256 == GSM8K_SHA
    assert data.template_sha256 == PREFIX_SHA and data.extra["prefix_chars"] == 2212
    assert [it.question_id for it in data.items] == list(range(5, 1319))  # demos 0-4 never scored
    first = data.items[0]
    assert first.prompt.endswith(
        "Question: "
        + json.loads((DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()[5])["question"]
        + "\nAnswer:"
    )
    assert first.prompt_sha256 == hashlib.sha256(first.prompt.encode()).hexdigest()
    pins = computed_pins(lane, data)
    assert pins["prompt_stream_sha256"].startswith("23c9eb5e8819755f")  # value in eval-protocol.md
    for k, v in load_pins("gsm8k").items():
        if k in pins:
            assert pins[k] == v, k


@pytest.mark.parametrize("name", ["aime26", "aime26-x16"])
def test_aime_lanes_match_pins(name):
    lane = get_lane(name)
    data = lane.load(None, allow_data_drift=False)
    assert data.dataset_sha256 == AIME26_SHA
    assert len(data.items) == 30 and data.items[0].question_id == "aime26-0"
    msg = data.items[0].prompt
    assert len(msg) == 1 and msg[0]["role"] == "user"
    assert msg[0]["content"].startswith(
        "Please reason step by step, and put your final answer within \\boxed{}.\n"
        "The answer is an integer between 0 and 999 inclusive.\n\n"
    )
    assert "2024 wording" in data.extra["prompt_wording"]
    pins = computed_pins(lane, data)
    assert {k: pins[k] for k in pins if k != "lane"} == {
        k: v for k, v in load_pins(name).items() if k in pins and k != "lane"
    }


def test_lane_protocol_parameters():
    g, a, x = get_lane("gsm8k"), get_lane("aime26"), get_lane("aime26-x16")
    assert g.api == "completions" and g.params["stop"] == ["Question", "Assistant:", "<|separator|>"]
    assert (g.params["temperature"], g.params["top_p"], g.params["seed"], g.params["max_tokens"], g.concurrency) == (
        0.0,
        1.0,
        0,
        4096,
        64,
    )
    assert a.api == "chat" and a.concurrency == 1 and a.params["reasoning_effort"] == "max"
    assert (a.params["temperature"], a.params["seed"], a.params["top_p"], a.params["max_tokens"]) == (
        0.0,
        0,
        0.95,
        65536,
    )
    assert x.repeats == 16 and x.concurrency == 64 and x.params["temperature"] == 1.0 and x.params["seed"] is None


def test_lanes_cli_lists_and_checks_pins():
    r = run_cli("lanes", "--check-pins", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [o["lane"] for o in out] == [
        "gsm8k",
        "aime26",
        "aime26-x16",
        "arith",
        "retrieval",
        "copy",
        "chat-copy",
        "chat-retrieval",
        "chat-arith-boxed",
        "chat-arith-boxed-think",
        "chat-arith-boxed-think-x16",
    ]
    assert all(o["differences"] == [] for o in out)


@pytest.mark.parametrize(
    "text,value",
    [
        (" 16 - 3 - 4 = 9 eggs.\n#### 18", 18),
        ("It costs 1,234 dollars", 1234),
        ("-10", 10),
        ("3.5", 5),
        ("answer 07", INVALID),
        ("no digits here", INVALID),
        ("", INVALID),
        ("0", 0),
    ],
)
def test_legacy_scorer(text, value):
    assert legacy_answer_value(text) == value


def test_boxed_extraction_is_last_box():
    assert extract_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert extract_boxed("no box") is None
    assert extract_boxed("\\boxed {5}") is None  # the vendored extractor's documented behaviour


def test_grader_pool_grades_and_times_out_without_hanging():
    with GraderPool(workers=1, timeout_s=1.5) as pool:
        assert pool.grade("16", "016").status == "ok" and pool.grade("16", "016").correct
        assert pool.grade("277", "m+n=277").correct
        assert not pool.grade("277", "278").correct
        slow = pool.grade("16", "9^{9^{9^{9}}}")  # math-verify needs ~10 s here; our hard deadline is 1.5 s
        assert slow.status == "grader_timeout" and slow.correct is False
        again = pool.grade("16", "16")  # the replacement worker answers
        assert again.status == "ok" and again.correct


def test_repeated_lane_metrics_formulas():
    """pass@1 = all-response correctness; pass@k, majority@k via NS; missing responses count wrong."""
    recs = []
    # q0: 2 of 4 correct, answers 5,5,7,None -> majority "5" (correct); q1: 0 correct, all None
    for r, (ans, ok) in enumerate([("5", True), ("5", True), ("7", False), (None, False)]):
        recs.append(
            {
                "lane": "L",
                "question_id": "q0",
                "repeat_index": r,
                "extracted_answer": ans,
                "correct": ok,
                "grade_status": "ok" if ans else "no_answer",
                "error": None,
                "truncated": False,
                "usage": None,
            }
        )
    for r in range(3):  # q1 repeat 3 is missing (partial run)
        recs.append(
            {
                "lane": "L",
                "question_id": "q1",
                "repeat_index": r,
                "extracted_answer": None,
                "correct": False,
                "grade_status": "no_answer",
                "error": None,
                "truncated": False,
                "usage": None,
            }
        )
    s = compute_summary(
        lane_name="L",
        grader="ns_last_boxed",
        repeats=4,
        planned_question_ids=["q0", "q1"],
        records=[as_record(r) for r in recs],
        meta={},
    )
    assert s["n_planned"] == 8 and s["n_records"] == 7 and s["n_missing"] == 1 and s["partial"] is True
    assert s["accuracy"] == s["pass@1"] == 2 / 8
    assert s["pass@4"] == 0.5 and s["majority@4"] == 0.5
    assert s["no_answer"] == pytest.approx((1 / 4 + 4 / 4) / 2)


def test_simulation_and_spec_blocks_are_recognised():
    from evalpipe.harness.server_facts import simulation_reason, spec_from_response

    assert simulation_reason({"simulate_acc_len": 2.5})
    assert simulation_reason({"speculative": {"simulate_acc_len": 3}})
    assert simulation_reason({"simulate_acc_len": -1}) is None
    assert simulation_reason({"speculative": {"simulate_acc_len": None}}) is None
    assert simulation_reason(None) is None
    spec = {"verify_steps": 4, "accept_length": 2.0, "simulated": False}
    assert spec_from_response({}, {"spec": spec}) == spec
    assert spec_from_response({"sglext": {"spec": {"accept_length": 3}}}, {}) == {"accept_length": 3}
    assert spec_from_response({}, {"meta_info": {"spec_verify_ct": 7, "e2e_latency": 1.0}}) == {"spec_verify_ct": 7}
    assert spec_from_response({"usage": {}}, {"text": "x"}) is None


def test_reader_keeps_landed_records_and_reports_a_torn_tail(tmp_path):
    from evalpipe.harness.records import RecordWriter, read_records

    path = tmp_path / "responses.jsonl"
    with RecordWriter(path) as w:
        w.write({"lane": "gsm8k", "question_id": 5, "repeat_index": 0})
        w.write({"lane": "gsm8k", "question_id": 6, "repeat_index": 0})
    with open(path, "a") as fh:
        fh.write('{"lane": "gsm8k", "quest')  # a writer killed mid-line
    got = read_records(path)
    assert [r["question_id"] for r in got.records] == [5, 6] and got.torn_tail and not got.bad_lines
