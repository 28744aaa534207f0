"""`evalpipe import sgl-eval`: real sgl-eval 0.1.0 runs (its CLI, against the scripted server as a stand-in peer)
become run folders that audit re-checks, re-grading with the same NeMo-Skills grader, and that compare pairs by
sgl-eval's id and repeat; a different generation config is refused; damaged files are named with their line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.core_helpers import load_run, run_cli
from tests.support.scripted_server import answer_table, mixed_bucket, start_scripted_server, stop_scripted_server

SGL_EVAL = str(Path(sys.executable).parent / "sgl-eval")
N, REPEATS = 4, 2  # in `mixed` mode these 4 questions get right, wrong and truncated answers


def sgl_eval_run(base_url: str, out: Path, *extra: str) -> Path:
    done = subprocess.run(
        [
            SGL_EVAL,
            "run",
            "aime26",
            "--base-url",
            base_url,
            "--num-examples",
            str(N),
            "--n-repeats",
            str(REPEATS),
            "--max-tokens",
            "64",
            "--seed",
            "0",
            "--out-dir",
            str(out),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (run,) = out.iterdir()
    return run


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two sgl-eval runs of one config and one with another --max-tokens, against the scripted server in `mixed`
    mode (right, wrong, truncated, unanswered and failing answers, fixed per question)."""
    root = tmp_path_factory.mktemp("sgl")
    base_url, proc = start_scripted_server(mode="mixed", answers=answer_table("aime26"))
    try:
        return {
            "a": sgl_eval_run(base_url, root / "a"),
            "b": sgl_eval_run(base_url, root / "b"),
            "other": sgl_eval_run(base_url, root / "other", "--max-tokens", "48"),
        }
    finally:
        stop_scripted_server(proc)


def imported(source: Path, out: Path, arm: str) -> Path:
    r = run_cli("import", "sgl-eval", source, "--out", out, "--arm", arm)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_import_keeps_what_sgl_eval_recorded_and_audit_regrades_it(sources, tmp_path):
    run = imported(sources["a"], tmp_path / "a", "a")
    records, summary, manifest = load_run(run)
    rows = {}
    for r in range(REPEATS):
        for line in (sources["a"] / f"output-rs{r}.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows[(row["id"], r)] = row
    assert {(rec["question_id"], rec["repeat_index"]) for rec in records} == set(rows) and len(rows) == N * REPEATS
    for rec in records:
        row = rows[(rec["question_id"], rec["repeat_index"])]
        assert (rec["response_text"], rec["extracted_answer"], rec["correct"], rec["finish_reason"]) == (
            row["generation"],
            row["predicted_answer"],
            row["symbolic_correct"],
            row["finish_reason"],
        )
        assert rec["usage"]["completion_tokens"] == row["num_generated_tokens"] and rec["latency_s"] >= 0
        assert rec["lane"] == "sgl-eval/aime26" and rec["output_token_ids"] is None
    buckets = {mixed_bucket(row["problem"]) for row in rows.values()}
    assert {"correct", "wrong"} <= buckets  # the grades checked below include both verdicts
    assert manifest["imported"]["tool"] == "sgl-eval" and manifest["imported"]["version"] == "0.1.0"
    assert manifest["imported"]["grader"] == "ns_last_boxed"
    assert "request body" in manifest["imported"]["not_recorded"]
    assert summary["n_planned"] == N * REPEATS and f"pass@{REPEATS}" in summary
    metrics = json.loads((sources["a"] / "metrics.json").read_text())
    assert summary[f"pass@{REPEATS}"] == pytest.approx(metrics["aggregate"][f"pass@{REPEATS}"])
    audit = run_cli("audit", run, "--no-progress")
    assert audit.returncode == 0, audit.stdout
    assert "OK   grades" in audit.stdout and "not recorded by sgl-eval" in audit.stdout
    resume = run_cli("run", "--resume", run, "--no-progress")
    assert resume.returncode == 2 and "was made by `evalpipe import` from sgl-eval" in resume.stderr

    # a flipped grade, with the file's pin updated to hide the edit, is caught by re-grading
    flipped = tmp_path / "flipped"
    shutil.copytree(run, flipped)
    lines = (flipped / "responses.jsonl").read_text().splitlines()
    victim = next(i for i, line in enumerate(lines) if not json.loads(line)["error"])
    rec = json.loads(lines[victim])
    rec["correct"] = not rec["correct"]
    lines[victim] = json.dumps(rec)
    (flipped / "responses.jsonl").write_text("\n".join(lines) + "\n")
    from evalpipe.digest import file_sha256

    manifest["responses_sha256"] = file_sha256(flipped / "responses.jsonl")
    (flipped / "manifest.json").write_text(json.dumps(manifest))
    audit = run_cli("audit", flipped, "--no-progress")
    assert audit.returncode == 1 and "FAIL grades" in audit.stdout
    assert f"{rec['question_id']}/{rec['repeat_index']}: the source says correct={rec['correct']}" in audit.stdout


def test_two_imports_compare_by_id_and_repeat_and_another_config_is_refused(sources, tmp_path):
    a = imported(sources["a"], tmp_path / "a", "a")
    b = imported(sources["b"], tmp_path / "b", "b")
    cmp = run_cli("compare", a, b, "--out", tmp_path / "cmp", "--no-html")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["repeated"] and result["paired_keys"] == N * REPEATS and result["accuracy"]["diff"] == 0
    other = imported(sources["other"], tmp_path / "other", "other")
    refused = run_cli("compare", a, other, "--out", tmp_path / "cmp2", "--no-html")
    assert refused.returncode == 1 and "gen.max_tokens: 64 vs 48" in refused.stderr, refused.stderr


def test_damaged_or_incomplete_sgl_eval_folders_are_named(sources, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(sources["a"], bad)
    rs1 = bad / "output-rs1.jsonl"
    rs1.write_bytes(rs1.read_bytes()[:50] + b"\xff" + rs1.read_bytes()[50:])
    r = run_cli("import", "sgl-eval", bad, "--out", tmp_path / "x")
    assert r.returncode == 2 and f"{rs1}:1: not UTF-8 (byte 0xff at column 51)" in r.stderr, r.stderr
    (bad / "metrics.json").unlink()
    r = run_cli("import", "sgl-eval", bad, "--out", tmp_path / "x")
    assert r.returncode == 2 and "no metrics.json beside the output-rs*.jsonl files" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()
    done = imported(sources["a"], tmp_path / "ok", "a")
    again = run_cli("import", "sgl-eval", sources["a"], "--out", done)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr


def test_a_missing_repeat_makes_the_import_partial(sources, tmp_path):
    """An example that lacks one of its repeats (an interrupted sgl-eval run) is imported as a partial run: audit's
    completeness check and compare's refusal say so."""
    cut = tmp_path / "cut"
    shutil.copytree(sources["b"], cut)
    rs1 = cut / "output-rs1.jsonl"
    lines = rs1.read_text().splitlines()
    dropped = json.loads(lines[-1])["id"]
    rs1.write_text("\n".join(lines[:-1]) + "\n")
    run = imported(cut, tmp_path / "run", "cut")
    _, summary, _ = load_run(run)
    assert summary["partial"] is True and summary["n_missing"] == 1 and summary["n_planned"] == N * REPEATS
    audit = run_cli("audit", run, "--no-progress")
    assert audit.returncode == 1 and "FAIL complete" in audit.stdout and repr(dropped) in audit.stdout
    full = imported(sources["a"], tmp_path / "a", "a")
    refused = run_cli("compare", full, run, "--out", tmp_path / "cmp", "--no-html")
    assert refused.returncode == 1 and "is partial" in refused.stderr, refused.stderr
