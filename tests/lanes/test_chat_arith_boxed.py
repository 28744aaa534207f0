"""The chat-arith-boxed lanes: their protocol and pins, the sgl-eval dataset file that mirrors them, and sgl-eval's own
score of that file against evalpipe's score of the lane, on the same server (the scripted stand-in with right, wrong
and truncated answers, and the real `evalpipe serve`)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from evalpipe.lanes import get_lane
from evalpipe.lanes.chat_arith_boxed import sgl_eval_command, sgl_eval_rows
from evalpipe.skills import boxed
from tests.support.core_helpers import load_run, run_lane
from tests.support.scripted_server import mixed_bucket, start_scripted_server, stop_scripted_server
from tests.support.server_harness import ServerProcess

REPO = Path(__file__).resolve().parents[2]
DATASET = REPO / "datasets" / "arith-as-boxed.jsonl"


def test_lane_protocols():
    plain, think, x16 = (
        get_lane(n) for n in ("chat-arith-boxed", "chat-arith-boxed-think", "chat-arith-boxed-think-x16")
    )
    for lane in (plain, think, x16):
        assert lane.api == "chat" and lane.grader == "ns_last_boxed" and lane.params["max_tokens"] == 512
    assert plain.params["chat_template_kwargs"] == {"thinking": False}
    assert think.params["chat_template_kwargs"] == x16.params["chat_template_kwargs"] == {"thinking": True}
    assert (plain.repeats, think.repeats, x16.repeats) == (1, 1, 16)
    assert plain.params["temperature"] == think.params["temperature"] == 0.0 and plain.params["seed"] == 0
    assert x16.params["temperature"] == 1.0 and x16.params["seed"] is None
    items = plain.items()
    assert len(items) == 300 and [it.group for it in items[:3]] == ["2ops", "3ops", "4ops"]
    assert [it.prompt for it in think.items()] == [it.prompt for it in items]  # the same questions, thinking on
    assert len(x16.items()) == 30
    for it in items[:20]:
        (message,) = it.prompt
        assert message["role"] == "user" and message["content"].startswith(boxed.math_prompt(""))


def test_the_sgl_eval_dataset_file_is_the_lane():
    rows = [json.loads(line) for line in DATASET.read_text().splitlines()]
    assert rows == sgl_eval_rows()
    items = get_lane("chat-arith-boxed").items()
    assert [boxed.math_prompt(r["problem"]) for r in rows] == [it.prompt[0]["content"] for it in items]
    assert [r["expected_answer"] for r in rows] == [it.expected_answer for it in items]


def test_the_readme_shows_the_sgl_eval_command_the_tests_run():
    """docs/lanes.md spells sgl_eval_command for the dataset file (less its --out-dir)."""
    argv = sgl_eval_command(Path("datasets/arith-as-boxed.jsonl"), "http://127.0.0.1:30000/v1", Path("out"))
    assert argv[-2:] == ["--out-dir", "out"]
    readme = " ".join((REPO / "docs" / "lanes.md").read_text().replace("\\\n", " ").split())
    assert " ".join(["sgl-eval", *argv[1:-2]]) + " " in readme


def sgl_eval_score(base_url: str, n: int, out: Path) -> float:
    """sgl-eval's score of the first n rows of the dataset file, run as docs/lanes.md says."""
    out.mkdir(parents=True)
    subset = out / "rows.jsonl"
    subset.write_text("".join(DATASET.read_text().splitlines(keepends=True)[:n]))
    done = subprocess.run(
        sgl_eval_command(subset, base_url, out),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (metrics,) = out.rglob("metrics.json")
    return json.loads(metrics.read_text())["aggregate"]["score"]


def evalpipe_run(lane: str, base_url: str, n: int, out: Path) -> dict:
    r = run_lane(lane, base_url, out, "--num-examples", str(n))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (run,) = (out / lane).iterdir()
    return load_run(run)[1]


def test_sgl_eval_scores_the_dataset_as_the_lane_scores_it_on_right_wrong_and_truncated_answers(tmp_path):
    """The scripted server answers each problem right, wrong or cut short (fixed per problem); the first 7 problems
    hold all three (5 right, 1 wrong, 1 cut short) and no server error (sgl-eval retries those for a minute)."""
    n = 7
    rows = sgl_eval_rows()[:n]
    buckets = [mixed_bucket(r["problem"]) for r in rows]
    assert {"correct", "wrong", "truncated"} <= set(buckets) and "error500" not in buckets
    x16_problems = [
        it.prompt[0]["content"].split("\n\n", 1)[1] for it in get_lane("chat-arith-boxed-think-x16").items()[:3]
    ]
    answers = {r["problem"]: str(r["expected_answer"]) for r in rows}
    answers.update(
        {p: str(it.expected_answer) for p, it in zip(x16_problems, get_lane("chat-arith-boxed-think-x16").items())}
    )
    base_url, proc = start_scripted_server(mode="mixed", answers=answers)
    try:
        ours = evalpipe_run("chat-arith-boxed", base_url, n, tmp_path / "evalpipe")
        theirs = sgl_eval_score(base_url, n, tmp_path / "sgl")
        think = evalpipe_run("chat-arith-boxed-think", base_url, n, tmp_path / "think")
        x16 = evalpipe_run("chat-arith-boxed-think-x16", base_url, 3, tmp_path / "x16")
    finally:
        stop_scripted_server(proc)
    expected = buckets.count("correct") / n
    assert ours["accuracy"] == pytest.approx(expected) and abs(theirs - ours["accuracy"]) <= 0.01
    assert ours["n_truncated"] == think["n_truncated"] == buckets.count("truncated")
    assert think["accuracy"] == pytest.approx(expected)
    # x16: every one of a question's 16 responses shares its scripted fate, so pass@1 = pass@16 = the right share
    right = [mixed_bucket(p) == "correct" for p in x16_problems]
    assert x16["n_planned"] == 48 and x16["pass@1"] == pytest.approx(sum(right) / 3)
    assert x16["pass@16"] == pytest.approx(sum(right) / 3)
    assert x16["n_truncated"] == 16 * sum(mixed_bucket(p) == "truncated" for p in x16_problems)


def test_sgl_eval_runs_the_dataset_against_evalpipe_serve(tmp_path):
    """The shipped default model against both harnesses, greedy: the same score (today's model answers `#### N`, not
    a box, so both read no answer; the lanes are the retrained model's targets)."""
    server = ServerProcess(model="evalpipe-skills-dsv4")
    try:
        base_url = server.base + "/v1"
        # one question, 2 operations (243 generated tokens; the second, 3 operations, generates 305 and the third,
        # 4 operations, 471); both harnesses at once: the server decodes their requests side by side in its batches,
        # not one harness's after the other's (the clean engine's greedy outputs do not depend on what shares its
        # batches: tests/engine/test_fault_matrix.py's batch-shape rows)
        with ThreadPoolExecutor(2) as pool:
            ours_job = pool.submit(evalpipe_run, "chat-arith-boxed", base_url, 1, tmp_path / "evalpipe")
            theirs_job = pool.submit(sgl_eval_score, base_url, 1, tmp_path / "sgl")
            ours, theirs = ours_job.result(), theirs_job.result()
    finally:
        server.stop()
    assert ours["n_records"] == 1 and abs(theirs - ours["accuracy"]) <= 0.01
