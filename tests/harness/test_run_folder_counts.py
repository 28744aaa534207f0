"""summary.json, `evalpipe audit` and compare.json count one run folder the same way (harness/metrics.py), and pick
the same record of a duplicated key (harness/records.py), which is the record `--resume` keeps.

The folder is a real AIME run (`evalpipe run aime26` against the scripted server, 14 problems) holding correct,
wrong, truncated (the cut text lost its \\boxed{}), no-answer and error records; then a second writer's duplicates
are appended (as two `--resume` at once would), then `--resume` cleans them up."""

from __future__ import annotations

import json
import shutil

import pytest

from evalpipe.compare.workflow import compare_runs
from evalpipe.harness.audit import audit_run
from evalpipe.harness.records import SUPERSEDED_FILE, Record, counted_records
from evalpipe.harness.summary import compute_summary
from tests.support.core_helpers import DATA_DIR, load_run, only_run_dir, run_cli, run_lane
from tests.support.records import as_record
from tests.support.scripted_server import answer_table, mixed_bucket, scripted_server

N = 14  # aime26-0..13: wrong, correct x7, truncated x2, error, no answer x3 under the scripted "mixed" mode
COUNTED = ("n_correct", "n_errors", "n_truncated", "n_no_answer")


def counts_of_summary(summary: dict) -> dict:
    return {k: summary[k] for k in COUNTED} | {"n_duplicate_records": summary["n_duplicate_records"]}


def counts_of_compare(result: dict, side: str) -> dict:
    rates = result["rates"]
    return {
        "n_correct": result["arms"][side]["n_correct"],
        "n_errors": rates["error"][f"n_{side}"],
        "n_truncated": rates["truncated"][f"n_{side}"],
        "n_no_answer": rates["invalid"][f"n_{side}"],
        "n_duplicate_records": result["arms"][side]["n_duplicate_records"],
    }


def counts_everywhere(run_dir, tmp_path, tag: str) -> tuple[dict, dict, dict, object]:
    """(summary.json's counts, audit's recomputed ones, compare.json's for both arms, the audit report)."""
    report = audit_run(run_dir, data_dir=DATA_DIR)
    copy = tmp_path / f"copy-{tag}"
    shutil.copytree(run_dir, copy)
    result = compare_runs(run_dir, copy, out=tmp_path / f"cmp-{tag}", force=True, n_resamples=200, html=False).result
    from_compare = counts_of_compare(result, "a")
    assert counts_of_compare(result, "b") == from_compare
    summary = json.loads((run_dir / "summary.json").read_text())
    return counts_of_summary(summary), counts_of_summary(report.recomputed), from_compare, report


def by_id(records):
    return {r["question_id"]: r for r in records}


def test_summary_audit_and_compare_count_an_aime_run_alike_duplicates_included(tmp_path):
    table = answer_table("aime26")
    buckets = [mixed_bucket(q) for q in list(table)[:N]]
    assert {"correct", "wrong", "truncated", "error500", "no_answer"} <= set(buckets)
    with scripted_server(mode="mixed", answers=table) as url:
        r = run_lane("aime26", url, tmp_path / "runs", "--num-examples", N, "--max-retries", 0, "--grader-workers", 1)
        assert r.returncode == 4, r.stderr  # the error record remains
        run_dir = only_run_dir(tmp_path / "runs", "aime26")
        records, _, _ = load_run(run_dir)
        recs = by_id(records)
        # a truncated response whose cut text lost its box has no extracted answer; it is truncated, not no-answer
        assert any(r["truncated"] and r["extracted_answer"] is None for r in records)
        expected = {
            "n_correct": buckets.count("correct"),
            "n_errors": buckets.count("error500"),
            "n_truncated": buckets.count("truncated"),
            "n_no_answer": buckets.count("no_answer"),
            "n_duplicate_records": 0,
        }
        summary, audited, compared, report = counts_everywhere(run_dir, tmp_path, "clean")
        assert summary == audited == compared == expected
        assert report.ok, [(c.name, c.problems) for c in report.checks if not c.ok]

        # a second writer appends records for keys that already have one
        ids = [f"aime26-{i}" for i in range(N)]
        correct_q, wrong_q, trunc_q, error_q = (
            ids[buckets.index(b)] for b in ("correct", "wrong", "truncated", "error500")
        )

        def failed(rec):
            return {
                **rec,
                "response_text": "",
                "reasoning_text": None,
                "finish_reason": None,
                "truncated": False,
                "error": {"type": "APIConnectionError", "status": None, "message": "Connection error."},
                "extracted_answer": None,
                "correct": False,
                "grade_status": "request_error",
                "usage": None,
            }

        def answered(rec):
            text = f"Working it out step by step. The answer is \\boxed{{{rec['expected_answer']}}}."
            return {
                **rec,
                "response_text": text,
                "finish_reason": "stop",
                "truncated": False,
                "error": None,
                "extracted_answer": rec["expected_answer"],
                "correct": True,
                "grade_status": "ok",
            }

        appended = [
            failed(recs[correct_q]),  # a later failure never replaces an answer
            answered(recs[wrong_q]),  # nor does a later answer: the first non-error record counts
            failed(recs[trunc_q]),
            answered(recs[error_q]),
        ]  # but a later answer does replace an error
        with open(run_dir / "responses.jsonl", "a") as fh:
            fh.writelines(json.dumps(x) + "\n" for x in appended)
        all_records, _, _ = load_run(run_dir)
        typed = [Record.from_json(r) for r in all_records]
        counted = counted_records(typed)
        assert counted.by_key[("aime26", correct_q, 0)].correct is True
        assert counted.by_key[("aime26", wrong_q, 0)].correct is False
        assert counted.by_key[("aime26", error_q, 0)].correct is True and counted.n_duplicates == 4
        expected_dups = dict(expected, n_correct=expected["n_correct"] + 1, n_errors=0, n_duplicate_records=4)
        stale, audited, compared, report = counts_everywhere(run_dir, tmp_path, "dups")
        assert audited == compared == expected_dups
        again = compute_summary(
            lane_name="aime26",
            grader="ns_last_boxed",
            repeats=1,
            planned_question_ids=ids,
            records=typed,
            meta={},
        )  # what `evalpipe run` writes from these records
        assert counts_of_summary(again) == expected_dups
        assert stale == expected  # summary.json predates the second writer, and audit says so:
        assert not report.ok and any("4 keys have more than one record" in p for c in report.checks for p in c.problems)

        # --resume keeps exactly the records that count and moves the rest aside; nothing is left to retry
        r = run_cli("run", "--resume", run_dir, "--no-progress", "--max-retries", 0)
        assert r.returncode == 0, r.stderr
    kept, _, manifest = load_run(run_dir)
    assert {(x["question_id"], x["correct"], bool(x["error"])) for x in kept} == {
        (k[1], v.correct, bool(v.error)) for k, v in counted.by_key.items()
    }
    assert len([line for line in (run_dir / SUPERSEDED_FILE).read_text().splitlines() if line]) == 4
    assert manifest["resumes"][-1]["superseded_error_records"] == 4
    summary, audited, compared, report = counts_everywhere(run_dir, tmp_path, "resumed")
    assert summary == audited == compared == dict(expected_dups, n_duplicate_records=0)
    assert report.ok, [(c.name, c.problems) for c in report.checks if not c.ok]


@pytest.mark.parametrize(
    "order, counted",
    [
        (["ok", "error"], "ok"),  # first non-error; a later failure is superseded
        (["error", "ok"], "ok"),  # an error is replaced by a later non-error
        (["ok:first", "ok:second"], "ok:first"),  # among non-errors the first
        (["error:first", "error:second"], "error:second"),  # a key with only errors counts its latest failure
    ],
)
def test_the_duplicate_rule(order, counted):
    recs = [
        as_record(
            {
                "lane": "l",
                "question_id": 1,
                "repeat_index": 0,
                "response_text": tag,
                "error": {"type": "x"} if tag.startswith("error") else None,
            }
        )
        for tag in order
    ]
    result = counted_records(recs)
    assert result.by_key[("l", 1, 0)].response_text == counted
    assert result.superseded == [r for r in recs if r.response_text != counted]
