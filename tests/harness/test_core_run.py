"""`evalpipe run` and `evalpipe audit` as real subprocesses against the scripted server over real HTTP."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time

import pytest

from evalpipe.harness.records import REQUIRED_KEYS
from evalpipe.lanes.grading import legacy_answer_value
from tests.support.core_helpers import (
    DATA_DIR,
    evalpipe_cmd,
    interruptible_evalpipe_cmd,
    load_run,
    only_run_dir,
    run_cli,
    run_lane,
)
from tests.support.scripted_server import (
    DEFAULT_CONFIG,
    answer_table,
    mixed_bucket,
    server_stats,
    set_config,
    start_scripted_server,
    stop_scripted_server,
)

GSM8K_ROWS = [json.loads(line) for line in (DATA_DIR / "gsm8k" / "test.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def server():
    """One scripted server for the module; each test sets the behaviour it needs."""
    answers = {**answer_table("gsm8k", DATA_DIR), **answer_table("aime26")}
    base_url, proc = start_scripted_server(answers=answers)
    yield base_url
    stop_scripted_server(proc)


@pytest.fixture
def srv(server):
    def configure(**changes):
        cfg = {k: v for k, v in DEFAULT_CONFIG.items() if k != "answers"}
        cfg.update(changes)
        set_config(server, **cfg)
        return server

    return configure


def _n_requests(base_url):
    return server_stats(base_url)["n_requests"]


def test_mixed_run_lands_every_item_once_and_counts_failures_in_the_denominator(srv, tmp_path):
    url = srv(mode="mixed")
    n = 60  # gsm8k items 5-64 fall in every bucket: 36 correct, 11 truncated, 5 wrong, 5 no answer, 3 error 500
    r = run_lane(
        "gsm8k",
        url,
        tmp_path,
        "--num-examples",
        n,
        "--concurrency",
        16,
        "--max-retries",
        1,
        "--arm",
        "spec_off",
        "--logprobs",
        2,
    )
    assert r.returncode == 4, r.stderr  # the always-500 bucket left error records: not a clean run
    assert "planned items have no successful response" in r.stderr and "evalpipe run --resume" in r.stderr
    assert "accuracy" in r.stdout and "run folder:" in r.stdout
    run_dir = only_run_dir(tmp_path, "gsm8k")
    assert run_dir.name.startswith("spec_off-")
    records, summary, manifest = load_run(run_dir)

    ids = list(range(5, 5 + n))
    assert sorted(rec["question_id"] for rec in records) == ids  # exactly once each
    for rec in records:
        assert not [k for k in REQUIRED_KEYS if k not in rec]
    buckets = {i: mixed_bucket(GSM8K_ROWS[i]["question"]) for i in ids}
    by_id = {rec["question_id"]: rec for rec in records}
    for i, b in buckets.items():
        rec = by_id[i]
        assert rec["correct"] == (b == "correct"), (i, b, rec["grade_status"])
        assert rec["expected_answer"] == legacy_answer_value(GSM8K_ROWS[i]["answer"])
        if b == "error500":
            assert rec["error"]["status"] == 500 and len(rec["attempts"]) == 2 and rec["response_text"] == ""
            assert rec["grade_status"] == "request_error"
        if b == "truncated":
            # the scripted truncation still contains the gold number: a truncation counts wrong anyway
            assert rec["truncated"] and rec["finish_reason"] == "length" and rec["grade_status"] == "truncated"
        if b == "correct":
            assert rec["output_token_ids"] and rec["request"]["return_token_ids"] is True
            assert rec["request"]["logprobs"] == 2 and len(rec["logprobs"]["top_logprobs"][0]) == 2
    expected_correct = sum(b == "correct" for b in buckets.values())
    assert summary["n_planned"] == summary["n_records"] == n
    assert summary["n_correct"] == expected_correct
    assert summary["accuracy"] == pytest.approx(expected_correct / n)
    assert summary["n_errors"] == sum(b == "error500" for b in buckets.values()) > 0
    assert summary["n_truncated"] == sum(b == "truncated" for b in buckets.values()) > 0
    assert summary["n_invalid"] == sum(b == "no_answer" for b in buckets.values()) > 0
    assert summary["partial"] is False and summary["arm"] == "spec_off"

    # request as sent: the lane's protocol, no key; manifest pins and provenance
    body = records[0]["request"]
    assert body["stop"] == ["Question", "Assistant:", "<|separator|>"] and body["seed"] == 0
    assert body["max_tokens"] == 4096 and body["temperature"] == 0.0 and "api_key" not in json.dumps(body)
    start = manifest["start"]
    assert start["dataset"]["sha256"] == "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14"
    assert start["prompts"]["prompt_stream_sha256_all"].startswith("23c9eb5e8819755f")
    assert start["server"]["models"]["data"][0]["id"] == "scripted-model"
    assert start["server"]["server_info_path"] == "/get_server_info"
    assert any(p.startswith("openai==") for p in start["packages"])
    assert manifest["end"] is not None and manifest["consistent"] is True

    # audit passes on the honest run ...
    a = run_cli("audit", run_dir)
    assert a.returncode == 0, a.stdout + a.stderr
    assert "audit passed" in a.stdout
    n_records = len((run_dir / "responses.jsonl").read_text().splitlines())
    assert "audit: re-grading" in a.stderr and f"{n_records}/{n_records}" in a.stderr  # the bar, on stderr only
    quiet = run_cli("audit", run_dir, "--no-progress")
    assert quiet.returncode == 0 and "re-grading" not in quiet.stderr and quiet.stdout == a.stdout
    # ... and fails once one record's raw text is edited
    original = (run_dir / "responses.jsonl").read_text()
    lines = original.splitlines()
    k = next(j for j, line in enumerate(lines) if json.loads(line)["grade_status"] == "no_answer")
    rec = json.loads(lines[k])
    rec["response_text"] = " edited.\n#### " + str(rec["expected_answer"])
    lines[k] = json.dumps(rec)
    (run_dir / "responses.jsonl").write_text("\n".join(lines) + "\n")
    a = run_cli("audit", run_dir)
    assert a.returncode == 1
    assert "FAIL grades" in a.stdout and str(rec["question_id"]) in a.stdout
    # ... and also when the edit changes no grade or count: the file no longer has the hash the run recorded
    assert manifest["responses_sha256"] == hashlib.sha256(original.encode()).hexdigest()
    lines = original.splitlines()
    rec = json.loads(lines[k])  # a no-answer record: one more trailing space still has no answer
    lines[k] = json.dumps({**rec, "response_text": rec["response_text"] + " "})
    (run_dir / "responses.jsonl").write_text("\n".join(lines) + "\n")
    a = run_cli("audit", run_dir)
    assert a.returncode == 1 and "responses.jsonl changed after the run finished" in a.stdout
    assert "FAIL grades" not in a.stdout and "FAIL summary" not in a.stdout


def test_unlisted_model_is_an_error_before_any_request(srv, tmp_path):
    url = srv(mode="correct")
    before = _n_requests(url)
    r = run_lane("gsm8k", url, tmp_path, "--num-examples", 3, "--model", "not-served")
    assert r.returncode == 1
    assert "not-served" in r.stderr and "scripted-model" in r.stderr and "Traceback" not in r.stderr
    assert _n_requests(url) == before
    assert not (tmp_path / "gsm8k").exists()


def test_unreachable_endpoint_is_a_clear_error(tmp_path):
    from tests.support.scripted_server import free_port

    r = run_lane("gsm8k", f"http://127.0.0.1:{free_port()}/v1", tmp_path, "--num-examples", 2)
    assert r.returncode == 1 and "cannot reach" in r.stderr and "Traceback" not in r.stderr


def test_server_change_during_the_run_is_flagged(srv, tmp_path):
    url = srv(mode="correct", delay_s=0.05, server_info={"version": "1"})
    proc = subprocess.Popen(
        evalpipe_cmd(
            "run",
            "gsm8k",
            "--base-url",
            url,
            "--out",
            tmp_path,
            "--num-examples",
            60,
            "--concurrency",
            1,
            "--no-progress",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob("gsm8k/*/responses.jsonl")):
        time.sleep(0.02)
    set_config(url, server_info={"version": "2"}, delay_s=0.0)  # the server "restarts" mid-run
    stdout, stderr = proc.communicate(timeout=60)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert r.returncode == 0, r.stderr
    run_dir = only_run_dir(tmp_path, "gsm8k")
    _, summary, manifest = load_run(run_dir)
    assert summary["manifest_changed"] is True and manifest["consistent"] is False
    assert any("server" in d and "version" in d for d in summary["manifest_changes"])
    assert "manifest changed" in r.stdout
    a = run_cli("audit", run_dir)
    assert a.returncode == 1 and "FAIL manifest" in a.stdout


def test_4xx_is_not_retried_and_5xx_is_retried_then_recorded(srv, tmp_path):
    url = srv(mode="error400")
    before = _n_requests(url)
    r = run_lane("gsm8k", url, tmp_path / "a", "--num-examples", 3, "--max-retries", 3)
    assert r.returncode == 4, r.stderr  # every item an error record: finished, but not clean
    assert "3 of 3 planned items have no successful response (BadRequestError x3)" in r.stderr
    records, summary, _ = load_run(only_run_dir(tmp_path / "a", "gsm8k"))
    assert _n_requests(url) - before == 3
    assert all(len(x["attempts"]) == 1 and x["error"]["status"] == 400 for x in records)
    assert summary["n_errors"] == 3 and summary["accuracy"] == 0.0

    url = srv(mode="error500")
    before = _n_requests(url)
    r = run_lane("gsm8k", url, tmp_path / "b", "--num-examples", 3, "--max-retries", 2)
    records, summary, _ = load_run(only_run_dir(tmp_path / "b", "gsm8k"))
    assert _n_requests(url) - before == 9
    assert all(
        len(x["attempts"]) == 3 and x["error"]["status"] == 500 and x["error"]["retries_exhausted"] for x in records
    )
    assert summary["n_records"] == summary["n_errors"] == 3

    url = srv(mode="correct", fail_first=1)  # one 500, then success: the record is clean
    r = run_lane("gsm8k", url, tmp_path / "c", "--num-examples", 2, "--max-retries", 2)
    records, summary, _ = load_run(only_run_dir(tmp_path / "c", "gsm8k"))
    assert all(len(x["attempts"]) == 2 and x["error"] is None and x["correct"] for x in records)
    assert summary["accuracy"] == 1.0


def test_timeouts_and_malformed_bodies_become_error_records(srv, tmp_path):
    url = srv(mode="timeout", timeout_sleep_s=5)
    run_lane("gsm8k", url, tmp_path / "t", "--num-examples", 2, "--timeout", "0.3", "--max-retries", 1)
    records, summary, _ = load_run(only_run_dir(tmp_path / "t", "gsm8k"))
    assert all(x["error"]["type"] == "APITimeoutError" and len(x["attempts"]) == 2 for x in records)
    assert summary["n_errors"] == 2 and summary["accuracy"] == 0.0

    url = srv(mode="malformed")
    run_lane("gsm8k", url, tmp_path / "m", "--num-examples", 2, "--max-retries", 1)
    records, summary, _ = load_run(only_run_dir(tmp_path / "m", "gsm8k"))
    assert all(x["error"]["type"] == "malformed_response" for x in records)
    assert summary["n_records"] == 2 and summary["n_errors"] == 2

    url = srv(mode="bad_shape")
    run_lane("aime26", url, tmp_path / "s", "--num-examples", 1, "--max-retries", 0)
    records, summary, _ = load_run(only_run_dir(tmp_path / "s", "aime26"))
    assert records[0]["error"]["type"] == "malformed_response" and "message" in records[0]["error"]["message"]
    assert summary["n_errors"] == 1 and summary["accuracy"] == 0.0


def test_data_drift_is_refused_unless_allowed(srv, tmp_path):
    url = srv(mode="correct")
    drifted = tmp_path / "data" / "gsm8k"
    drifted.mkdir(parents=True)
    text = (DATA_DIR / "gsm8k" / "test.jsonl").read_text()
    (drifted / "test.jsonl").write_text(text.replace("Janet", "Janey", 1))
    r = run_lane("gsm8k", url, tmp_path / "out", "--num-examples", 2, "--data-dir", tmp_path / "data")
    assert r.returncode == 1 and "--allow-data-drift" in r.stderr and "sha256" in r.stderr
    assert not (tmp_path / "out").exists()
    r = run_lane(
        "gsm8k", url, tmp_path / "out", "--num-examples", 2, "--data-dir", tmp_path / "data", "--allow-data-drift"
    )
    assert r.returncode == 0, r.stderr
    _, summary, manifest = load_run(only_run_dir(tmp_path / "out", "gsm8k"))
    assert summary["data_drift"] is True and manifest["start"]["dataset"]["allow_data_drift"] is True
    assert manifest["start"]["dataset"]["pin_differences"]


def test_overrides_are_sent_and_recorded(srv, tmp_path):
    url = srv(mode="correct", spec={"verify_steps": 3, "accept_length": 2.5, "simulated": False})
    r = run_lane(
        "gsm8k",
        url,
        tmp_path,
        "--num-examples",
        2,
        "--max-tokens",
        64,
        "--temperature",
        0.5,
        "--seed",
        "none",
        "--top-p",
        0.9,
        "--no-token-ids",
        "--api-key",
        "sk-secret-123",
    )
    assert r.returncode == 0, r.stderr
    records, summary, manifest = load_run(only_run_dir(tmp_path, "gsm8k"))
    body = records[0]["request"]
    assert body["max_tokens"] == 64 and body["temperature"] == 0.5 and body["top_p"] == 0.9
    assert "seed" not in body and "return_token_ids" not in body and records[0]["output_token_ids"] is None
    assert summary["overrides"] == {"max_tokens": 64, "temperature": 0.5, "seed": None, "top_p": 0.9, "num_examples": 2}
    assert manifest["start"]["lane"]["overrides"]["seed"] is None
    assert "sk-secret-123" not in (only_run_dir(tmp_path, "gsm8k") / "manifest.json").read_text()
    assert "sk-secret-123" not in (only_run_dir(tmp_path, "gsm8k") / "responses.jsonl").read_text()
    assert records[0]["spec"]["accept_length"] == 2.5 and summary["spec_accept_length_mean"] == 2.5


def test_repeats_send_distinct_seeds(srv, tmp_path):
    """`--repeats 3 --temperature 1` on a seeded lane: repeat r of every item sends seed + r (one seed for all three
    would make them copies of one sample), and a run without repeats keeps the lane's seed."""
    url = srv(mode="correct")
    r = run_lane("arith", url, tmp_path, "--num-examples", 2, "--repeats", 3, "--temperature", 1, "--seed", 40)
    assert r.returncode == 0, r.stderr
    records, summary, _ = load_run(only_run_dir(tmp_path, "arith"))
    seeds = {(rec["question_id"], rec["repeat_index"]): rec["request"]["seed"] for rec in records}
    assert len(seeds) == 6 and all(seed == 40 + rep for (_, rep), seed in seeds.items())
    r = run_lane("arith", url, tmp_path / "one", "--num-examples", 2)
    records, _, _ = load_run(only_run_dir(tmp_path / "one", "arith"))
    assert [rec["request"]["seed"] for rec in records] == [0, 0]


def test_prepare_returns_a_frozen_plan_that_execute_consumes(srv, tmp_path):
    """`LaneRun.prepare` settles everything before the first request (items, repeats, parameters, the server's model)
    in a frozen plan; `execute(plan)` sends exactly that plan, and each line of responses.jsonl keeps `Record`'s key
    order (arith has groups: `group` sits between prompt_sha256 and request)."""
    import dataclasses
    import random

    from evalpipe.harness.lane_run import LaneRun, RunConfig
    from evalpipe.harness.records import Record
    from evalpipe.lanes import get_lane

    url = srv(mode="correct")
    n, repeats, seed = random.randint(1, 4), random.randint(1, 3), random.randint(0, 1000)
    run = LaneRun(
        RunConfig(
            lane=get_lane("arith"),
            base_url=url,
            out_dir=tmp_path,
            num_examples=n,
            repeats=repeats,
            overrides={"seed": seed},
            data_dir=DATA_DIR,
            progress=False,
        )
    )
    plan = run.prepare()
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.repeats = repeats + 1
    assert len(plan.items) == n and plan.repeats == repeats and plan.params["seed"] == seed
    assert not list(tmp_path.iterdir())  # nothing is written before execute
    outcome = run.execute(plan)
    assert outcome.exit_code == 0, outcome.message
    records, summary, manifest = load_run(outcome.run_dir)
    assert summary["n_planned"] == len(records) == n * repeats
    assert manifest["start"]["lane"]["effective"]["model"] == plan.model
    order = [f.name for f in dataclasses.fields(Record)]
    for line in (outcome.run_dir / "responses.jsonl").read_text().splitlines():
        keys = list(json.loads(line))
        assert "group" in keys and keys == [k for k in order if k in keys]


def test_lossy_acceptance_is_scored_and_shown_and_audit_guards_it(srv, tmp_path):
    """A server with SGLang thresholds below 1.0 is scored (unlike simulation); the summary names the setting and
    counts the responses whose spec says lossy; audit accepts a summary from before these keys only where the
    records are exact, so deleting a true spec_lossy is caught."""
    info = {"speculative_accept_threshold_single": 0.6, "speculative_accept_threshold_acc": 1.0}
    url = srv(mode="correct", server_info=info, spec={"accept_length": 2.0, "lossy": True})
    r = run_lane("gsm8k", url, tmp_path / "lossy", "--num-examples", 3)
    assert r.returncode == 0, r.stderr
    assert "LOSSY" in r.stderr and "LOSSY speculative acceptance" in r.stdout
    run_dir = only_run_dir(tmp_path / "lossy", "gsm8k")
    _, summary, _ = load_run(run_dir)
    assert summary["spec_lossy"] is True and summary["n_records_lossy"] == 3 and summary["accuracy"] == 1.0
    assert summary["server_lossy_acceptance"]["threshold_single"] == 0.6
    assert run_cli("audit", run_dir).returncode == 0
    edited = {k: v for k, v in summary.items() if k not in ("spec_lossy", "n_records_lossy")}
    (run_dir / "summary.json").write_text(json.dumps(edited))
    tampered = run_cli("audit", run_dir)
    assert tampered.returncode != 0 and "spec_lossy" in tampered.stdout + tampered.stderr

    url = srv(mode="correct", spec={"accept_length": 2.0})
    r = run_lane("gsm8k", url, tmp_path / "exact", "--num-examples", 2)
    assert r.returncode == 0, r.stderr
    run_dir = only_run_dir(tmp_path / "exact", "gsm8k")
    _, summary, _ = load_run(run_dir)
    assert (summary["spec_lossy"], summary["n_records_lossy"], summary["server_lossy_acceptance"]) == (False, 0, None)
    older = {k: v for k, v in summary.items() if k not in ("spec_lossy", "n_records_lossy")}
    (run_dir / "summary.json").write_text(json.dumps(older))  # as written before these keys existed
    assert run_cli("audit", run_dir).returncode == 0


def test_simulated_acceptance_is_refused(srv, tmp_path):
    url = srv(mode="correct", server_info={"speculative": {"simulate_acc_len": 3.0}})
    before = _n_requests(url)
    r = run_lane("gsm8k", url, tmp_path / "a", "--num-examples", 2)
    assert r.returncode == 1 and "simulat" in r.stderr and _n_requests(url) == before

    url = srv(mode="correct", spec={"accept_length": 3.0, "simulated": True})
    r = run_lane("gsm8k", url, tmp_path / "b", "--num-examples", 20, "--concurrency", 1)
    assert r.returncode == 3 and "simulated" in r.stderr
    records, summary, _ = load_run(only_run_dir(tmp_path / "b", "gsm8k"))
    assert 1 <= len(records) < 20  # kept, and the run stopped
    assert summary["refused"] and summary["accuracy"] is None and summary["partial"] is True


def test_sigint_keeps_records_then_resume_completes_without_duplicates(srv, tmp_path):
    url = srv(mode="mixed", delay_s=0.02)
    n = 300
    out = tmp_path / "out"
    proc = subprocess.Popen(
        interruptible_evalpipe_cmd(
            "run",
            "gsm8k",
            "--base-url",
            url,
            "--out",
            out,
            "--num-examples",
            n,
            "--concurrency",
            4,
            "--max-retries",
            0,
            "--no-progress",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 60
    responses = None
    while time.time() < deadline:
        found = list(out.glob("gsm8k/*/responses.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 20:
            responses = found[0]
            break
        time.sleep(0.05)
    assert responses is not None, proc.stderr.read() if proc.poll() is not None else "no records appeared"
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    run_dir = responses.parent
    records, summary, manifest = load_run(run_dir)  # every line parses
    assert 20 <= len(records) < n
    assert summary["partial"] is True and summary["interrupted"] == "SIGINT"
    assert summary["n_records"] == len(records) and summary["n_planned"] == n
    assert summary["accuracy"] == pytest.approx(summary["n_correct"] / n)
    assert manifest["end"] is not None
    a = run_cli("audit", run_dir)
    assert a.returncode == 1 and "FAIL complete" in a.stdout and "partial" in a.stdout

    # resume with a healthy server: error records are retried, nothing is duplicated
    url = srv(mode="correct")
    n_errors_before = sum(1 for x in records if x["error"])
    r = run_cli("run", "--resume", run_dir, "--base-url", url, "--no-progress")
    assert r.returncode == 0, r.stderr
    records2, summary2, manifest2 = load_run(run_dir)
    keys = [(x["question_id"], x["repeat_index"]) for x in records2]
    assert len(keys) == len(set(keys)) == n
    assert summary2["partial"] is False and summary2["resumed"] is True and summary2["n_errors"] == 0
    assert len(manifest2["resumes"]) == 1
    superseded = run_dir / "superseded.jsonl"
    assert (len(superseded.read_text().splitlines()) if superseded.exists() else 0) == n_errors_before
    kept = {x["question_id"]: x for x in records if not x["error"]}
    after = {y["question_id"]: y for y in records2}
    assert all(after[q] == rec for q, rec in kept.items())  # landed records are kept verbatim
    a = run_cli("audit", run_dir)
    assert a.returncode == 0, a.stdout


def test_resume_refuses_protocol_flags(srv, tmp_path):
    url = srv(mode="correct")
    run_lane("gsm8k", url, tmp_path, "--num-examples", 2)
    run_dir = only_run_dir(tmp_path, "gsm8k")
    r = run_cli("run", "--resume", run_dir, "--base-url", url, "--temperature", "1")
    assert r.returncode == 2 and "--temperature" in r.stderr
    # a server that now describes itself differently is a different protocol: refused, folder untouched
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    set_config(url, server_info={"scripted": True, "speculative": {"mode": "block"}})
    r = run_cli("run", "--resume", run_dir, "--base-url", url)
    assert r.returncode == 1 and "protocol changed" in r.stderr and "speculative" in r.stderr
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


def test_resume_after_the_same_server_restarted(srv, tmp_path):
    """A restart (the usual reason to resume) gives a new pid, load time and model `created`: not a new protocol."""
    url = srv(mode="correct", server_info={"model": "m", "load_seconds": 1.6, "runner": {"pid": 100}})
    run_lane("gsm8k", url, tmp_path, "--num-examples", 2)
    run_dir = only_run_dir(tmp_path, "gsm8k")
    set_config(url, server_info={"model": "m", "load_seconds": 1.8, "runner": {"pid": 200}})
    r = run_cli("run", "--resume", run_dir, "--base-url", url, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert len(load_run(run_dir)[0]) == 2


def test_num_examples_beyond_the_lane_says_so(srv, tmp_path):
    url = srv(mode="correct")
    r = run_lane("aime26", url, tmp_path, "--num-examples", 1000, "--grader-workers", 1)
    assert r.returncode == 0, r.stderr
    assert "--num-examples 1000 is more than lane aime26 has; it ran all 30 scored items" in r.stderr
    assert load_run(only_run_dir(tmp_path, "aime26"))[1]["n_planned"] == 30


def test_aime_x16_subset_metrics_and_audit(srv, tmp_path):
    url = srv(mode="mixed")
    r = run_lane("aime26-x16", url, tmp_path, "--num-examples", 3, "--grader-workers", 1)
    assert r.returncode == 0, r.stderr
    run_dir = only_run_dir(tmp_path, "aime26-x16")
    records, summary, _ = load_run(run_dir)
    assert summary["n_planned"] == summary["n_records"] == 48
    assert sorted({x["repeat_index"] for x in records}) == list(range(16))
    assert "seed" not in records[0]["request"] and records[0]["request"]["chat_template_kwargs"] == {"thinking": True}
    assert records[0]["reasoning_text"] == "thinking..."
    per_q = {}
    for x in records:
        per_q.setdefault(x["question_id"], []).append(x["correct"])
    # mixed mode is deterministic per question: all 16 repeats share one behaviour
    assert all(len(set(v)) == 1 for v in per_q.values())
    n_right_q = sum(v[0] for v in per_q.values())
    assert summary["accuracy"] == summary["pass@1"] == pytest.approx(16 * n_right_q / 48)
    assert summary["pass@16"] == pytest.approx(n_right_q / 3) and summary["majority@16"] == pytest.approx(n_right_q / 3)
    a = run_cli("audit", run_dir)
    assert a.returncode == 0, a.stdout


def test_aime_grader_timeout_is_recorded_not_hung(server, tmp_path):
    """A pathological boxed answer makes math-verify work ~10 s; the hard timeout (1 s) records grader_timeout."""
    table = answer_table("aime26")
    first_problem = next(iter(table))
    set_config(
        server,
        **{k: v for k, v in DEFAULT_CONFIG.items() if k != "answers"},
        answers={**table, first_problem: "9^{9^{9^{9}}}"},
    )
    try:
        r = run_lane("aime26", server, tmp_path, "--num-examples", 2, "--grader-timeout", 1, "--grader-workers", 1)
        assert r.returncode == 0, r.stderr
        records, summary, _ = load_run(only_run_dir(tmp_path, "aime26"))
        by_id = {x["question_id"]: x for x in records}
        assert by_id["aime26-0"]["grade_status"] == "grader_timeout" and by_id["aime26-0"]["correct"] is False
        assert by_id["aime26-1"]["grade_status"] == "ok" and by_id["aime26-1"]["correct"] is True
        assert summary["n_grader_timeouts"] == 1 and summary["accuracy"] == 0.5
    finally:
        set_config(server, answers={**table, **answer_table("gsm8k", DATA_DIR)})
