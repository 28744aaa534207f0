"""lm-evaluation-harness 0.4.13, for real, against `evalpipe serve` with the default model: its generate_until score
on evalpipe's arith items equals evalpipe's own run, text for text; two of its runs (speculation off and block) are
imported with `evalpipe import lm-eval`, audited and compared; its chat route works too. The task YAML is
lm_eval_tasks/evalpipe_arith_gen.yaml. Needs `make lmeval-env` (skips without it; fails under CI)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from evalpipe.digest import file_sha256
from tests.support.core_helpers import load_run, only_run_dir, run_cli, run_lane
from tests.support.lmeval_env import REPO, TASKS, require_lmeval, run_lmeval
from tests.support.server_harness import ServerProcess

LIMIT = 30
MODEL = "evalpipe-skills-dsv4"


@pytest.fixture(scope="module")
def servers():
    require_lmeval()
    off = ServerProcess(model=MODEL)
    try:
        block = ServerProcess("--speculative", "block", model=MODEL)
    except BaseException:
        off.stop()
        raise
    yield {"off": off.base + "/v1", "block": block.base + "/v1"}
    off.stop()
    block.stop()


@pytest.fixture(scope="module")
def lmeval_runs(servers, tmp_path_factory):
    """lm-eval's output folders of the arith task, one per server."""
    root = tmp_path_factory.mktemp("lmeval")
    return {arm: run_lmeval(url, root / arm, limit=LIMIT) for arm, url in servers.items()}


def samples_of(out, task="evalpipe_arith_gen"):
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def results_of(out):
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())


def test_lmeval_generate_score_and_texts_equal_evalpipe_run(servers, lmeval_runs, tmp_path):
    r = run_lane("arith", servers["off"], tmp_path, "--num-examples", str(LIMIT))
    assert r.returncode == 0, r.stderr
    records, summary, _ = load_run(only_run_dir(tmp_path, "arith"))
    ours = {rec["question_id"]: rec for rec in records}
    theirs = samples_of(lmeval_runs["off"])
    assert sorted(s["doc_id"] for s in theirs) == sorted(ours) == list(range(LIMIT))
    for s in theirs:
        rec = ours[s["doc_id"]]
        assert s["arguments"]["gen_args_0"]["arg_0"] == rec["request"]["prompt"]
        assert s["resps"][0][0] == rec["response_text"], s["doc_id"]
        assert bool(s["exact_match"]) == rec["correct"], s["doc_id"]
    score = results_of(lmeval_runs["off"])["results"]["evalpipe_arith_gen"]["exact_match,last-integer"]
    assert score == summary["accuracy"] == summary["n_correct"] / LIMIT
    assert 0 < summary["n_correct"] < LIMIT  # both outcomes occur, so the equality says something


def test_two_lmeval_runs_imported_audited_and_compared(lmeval_runs, tmp_path):
    runs = {}
    for arm, out in lmeval_runs.items():
        runs[arm] = tmp_path / arm
        r = run_cli("import", "lm-eval", out, "--out", runs[arm], "--arm", arm)
        assert r.returncode == 0, r.stderr
        assert "imported 30 records of lm-eval/evalpipe_arith_gen" in r.stdout
        audit = run_cli("audit", runs[arm], "--no-progress")
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert "OK   grades" in audit.stdout and "not recorded by lm-eval: finish_reason" in audit.stdout
        records, summary, manifest = load_run(runs[arm])
        assert manifest["imported"]["tool"] == "lm-eval" and manifest["imported"]["version"] == "0.4.13"
        assert manifest["imported"]["model_args"]["model"] == MODEL and "usage" in manifest["imported"]["not_recorded"]
        samples = {s["doc_id"]: s for s in samples_of(lmeval_runs[arm])}
        for rec in records:
            s = samples[rec["question_id"]]
            assert (rec["response_text"], rec["extracted_answer"], rec["correct"]) == (
                s["resps"][0][0],
                s["filtered_resps"][0],
                bool(s["exact_match"]),
            )
            assert rec["finish_reason"] is None and rec["usage"] is None
        assert summary["accuracy"] == manifest["imported"]["source_score"]
    cmp = run_cli("compare", runs["off"], runs["block"], "--out", tmp_path / "cmp", "--no-html")
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert result["paired_keys"] == LIMIT and result["lane"] == "lm-eval/evalpipe_arith_gen"
    # block speculation is lossless under greedy decoding: every text identical, no flips
    assert result["agreement"]["n_identical"] == LIMIT and result["flips"] == []
    assert result["manifest_diff"]["n_unintended"] == 0
    assert result["spec"]["a"]["not_recorded"] and "not recorded by the source" in cmp.stdout

    # an edited document or prompt no longer matches lm-eval's own hashes (the responses pin updated to hide it)
    edited = tmp_path / "edited"
    shutil.copytree(runs["off"], edited)
    lines = (edited / "responses.jsonl").read_text().splitlines()
    rec = json.loads(lines[2])
    rec["source"]["doc"]["expected_answer"] = "0"
    rec["request"]["prompt"] += " "
    lines[2] = json.dumps(rec)
    (edited / "responses.jsonl").write_text("\n".join(lines) + "\n")
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["responses_sha256"] = file_sha256(edited / "responses.jsonl")
    (edited / "manifest.json").write_text(json.dumps(manifest))
    audit = run_cli("audit", edited, "--no-progress")
    assert audit.returncode == 1 and "FAIL prompts" in audit.stdout, audit.stdout
    for what in ("lm-eval's doc_hash", "lm-eval's prompt_hash", "prompt_sha256 is not the sha256"):
        assert f"{rec['question_id']}/0: {what}" in audit.stdout, audit.stdout

    # another task configuration is refused, as for native runs: exit 1, the differing key named
    changed = tmp_path / "changed"
    shutil.copytree(runs["block"], changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    for snap in ("start", "end"):
        manifest[snap]["lane"]["spec"]["config"]["generation_kwargs"]["max_gen_toks"] = 256
    (changed / "manifest.json").write_text(json.dumps(manifest))
    refused = run_cli("compare", runs["off"], changed, "--out", tmp_path / "cmp2", "--no-html")
    assert refused.returncode == 1 and "max_gen_toks" in refused.stderr, refused.stderr


def test_lmeval_chat_completions_generate(servers, tmp_path):
    out = run_lmeval(
        servers["off"], tmp_path / "chat", model="local-chat-completions", limit=10, extra=("--apply_chat_template",)
    )
    samples = samples_of(out)
    assert len(samples) == 10 and all(s["resps"][0][0].strip() for s in samples)
    (results_file,) = out.rglob("results_*.json")  # the results file itself names the run as well as its folder
    r = run_cli("import", "lm-eval", results_file, "--out", tmp_path / "run", "--arm", "chat")
    assert r.returncode == 0, r.stderr
    audit = run_cli("audit", tmp_path / "run", "--no-progress")
    assert audit.returncode == 0, audit.stdout
    records, summary, _ = load_run(tmp_path / "run")
    # the messages lm-eval sent, as it logged and hashed them
    assert all(json.loads(rec["request"]["prompt"])[0]["role"] == "user" for rec in records)
    assert summary["n_correct"] == sum(bool(s["exact_match"]) for s in samples)


def test_damaged_lmeval_output_is_named_with_its_line(lmeval_runs, tmp_path):
    def copy(name):
        dest = tmp_path / name
        shutil.copytree(lmeval_runs["off"], dest)
        return dest, next(dest.rglob("samples_*.jsonl")), next(dest.rglob("results_*.json"))

    def refused(source, *needles, args=()):
        r = run_cli("import", "lm-eval", source, "--out", tmp_path / "out", *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        for needle in needles:
            assert needle in r.stderr, r.stderr
        assert not (tmp_path / "out").exists()

    src, samples, results = copy("bytes")
    lines = samples.read_bytes().split(b"\n")
    lines[6] = lines[6][:20] + b"\xe9" + lines[6][20:]
    samples.write_bytes(b"\n".join(lines))
    refused(src, f"{samples}:7: not UTF-8 (byte 0xe9 at column 21)")
    src, samples, results = copy("json")
    results.write_text(results.read_text()[:200])
    refused(src, f"{results}:", "not valid JSON")
    src, samples, results = copy("nosamples")
    samples.unlink()
    refused(src, "no samples_<task>_", "--log_samples")
    src, samples, results = copy("task")
    refused(src, "no samples of task 'nope'", args=("--task", "nope"))
    refused(src, "no metric 'acc' (it has: exact_match)", args=("--metric", "acc"))
    two = tmp_path / "two"
    shutil.copytree(lmeval_runs["off"], two / "x")
    shutil.copytree(lmeval_runs["block"], two / "y")
    refused(two, "holds 2 lm-eval runs", "import one results_*.json file")


MC_TASK = """task: evalpipe_mc_probe
custom_dataset: !function evalpipe_lanes.arith_dataset
output_type: multiple_choice
test_split: test
doc_to_text: "{{prompt}}"
doc_to_choice: "{{[group, expected_answer, 'none']}}"
doc_to_target: 1
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def test_a_multiple_choice_run_is_imported_and_its_acc_re_derived(tmp_path):
    """A loglikelihood task's log (lm-eval's own `dummy` model scores the choices at random, no server needed): each
    document's response is its best-scoring choice, audit re-derives acc from the logged loglikelihoods."""
    lm_eval = require_lmeval()
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "mc.yaml").write_text(MC_TASK)
    shutil.copy(TASKS / "evalpipe_lanes.py", tasks)
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    env.update(PYTHONPATH=str(REPO), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(
        [
            lm_eval,
            "--model",
            "dummy",
            "--include_path",
            str(tasks),
            "--tasks",
            "evalpipe_mc_probe",
            "--limit",
            "24",
            "--output_path",
            str(tmp_path / "out"),
            "--log_samples",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = run_cli("import", "lm-eval", tmp_path / "out", "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    records, summary, _ = load_run(tmp_path / "run")
    samples = {s["doc_id"]: s for s in samples_of(tmp_path / "out", "evalpipe_mc_probe")}
    for rec in records:
        s = samples[rec["question_id"]]
        lls = [float(x[0]) for x in s["filtered_resps"]]
        assert rec["logprobs"]["choice_loglikelihoods"] == lls
        assert rec["extracted_answer"] == lls.index(max(lls)) and rec["correct"] == bool(s["acc"])
        assert rec["response_text"] == s["arguments"][f"gen_args_{rec['extracted_answer']}"]["arg_1"]
    assert 0 < summary["n_correct"] < 24  # random scores: both outcomes occur
    assert run_cli("audit", tmp_path / "run", "--no-progress").returncode == 0

    flipped = tmp_path / "flipped"
    shutil.copytree(tmp_path / "run", flipped)
    lines = (flipped / "responses.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])
    rec["correct"] = not rec["correct"]
    lines[3] = json.dumps(rec)
    (flipped / "responses.jsonl").write_text("\n".join(lines) + "\n")
    audit = run_cli("audit", flipped, "--no-progress")
    assert audit.returncode == 1 and "FAIL grades" in audit.stdout
    assert f"{rec['question_id']}: the source says correct={rec['correct']}" in audit.stdout
