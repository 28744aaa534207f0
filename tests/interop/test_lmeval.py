"""lm-evaluation-harness 0.4.13, for real, against `evalpipe serve` with the default model.

- generate_until (lm_eval_tasks/evalpipe_arith_gen.yaml): its score on evalpipe's arith items equals evalpipe's own
  run, text for text; two of its runs (speculation off and block) are imported with `evalpipe import lm-eval`,
  audited and compared.
- chat (evalpipe_arith_chat.yaml through `local-chat-completions`): its replies are the server's own answers, and
  the run imports and audits.
- multiple choice (evalpipe_arith_mc.yaml through `local-completions` with the server's remote tokenizer): above
  chance, with the model's own loglikelihoods; a run of lm-eval's `dummy` model imports with acc re-derived.

Two module servers (speculation off and block); every lm-eval run of the module is made up front by two lm-eval
processes side by side, each running several (tests/support/lmeval_env.py says why), and evalpipe's own run and chat
replies beside them (`made` says why).
Needs `make lmeval-env` (skips without it; fails under CI)."""

from __future__ import annotations

import json
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import pytest
import torch

from evalpipe.digest import file_sha256
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.tokenizer import ByteTokenizer
from evalpipe.lanes import get_lane
from evalpipe.lanes.skill_lane import lane_examples
from tests.support.core_helpers import load_run, only_run_dir, run_cli, run_lane
from tests.support.lmeval_env import TASKS, lmeval_args, require_lmeval, run_lmeval_batch
from tests.support.server_harness import ServerProcess

# the window-64 model: it misses some of the items below (the default answers all), so score equality sees both
# outcomes
MODEL = "evalpipe-skills-dsv4-w64"
TOK = ByteTokenizer()
# arith documents per generate run: 8 of the first 12 are right, so the score equality sees both outcomes. The server
# decodes them as one batch, as long as the longest answer (430 tokens in 0..11, 461 in 0..29), so the cost grows
# slowly with their number: 12 took 14 s of the server's CPU, 30 took 23 s (on the loaded 2-core machine)
LIMIT = 12
CHAT_ITEMS = 3  # chat documents (0..2: one wrong, two right)
MC_ITEMS = 10  # multiple-choice documents: 10 x 4 scored prompts
CHECKED_DOCS = 3  # of those, documents whose every choice is recomputed in this process (each forward costs a prefill)
PROBE_ITEMS = 24  # documents of the dummy model's random multiple choice


@pytest.fixture(scope="module")
def servers():
    require_lmeval()
    with ThreadPoolExecutor(2) as pool:  # the two boots overlap
        boots = {
            "off": pool.submit(ServerProcess, model=MODEL),
            "block": pool.submit(ServerProcess, "--speculative", "block", model=MODEL),
        }
    started = {arm: boot.result() for arm, boot in boots.items() if boot.exception() is None}
    if len(started) < len(boots):
        for srv in started.values():
            srv.stop()
        for boot in boots.values():
            boot.result()  # raises the failed boot's error
    yield started
    codes = {arm: srv.stop() for arm, srv in started.items()}
    assert codes == {"off": 0, "block": 0}, {arm: srv.output()[-3000:] for arm, srv in started.items()}


MC_PROBE_TASK = """task: evalpipe_mc_probe
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


def chat_replies(base_url: str) -> dict[str, str]:
    """The server's own greedy replies to the first CHAT_ITEMS arith stories (the chat task's documents), by story,
    each asked as the task asks it: the story as the user's message, stop at a blank line."""
    bodies = [ex.body for _, ex in lane_examples(get_lane("arith"))][:CHAT_ITEMS]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    def reply(body: str) -> str:
        messages = [{"role": "user", "content": body}]
        answer = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=512, temperature=0, stop=["\n\n"]
        )
        return answer.choices[0].message.content

    with ThreadPoolExecutor(len(bodies)) as pool:
        return dict(zip(bodies, pool.map(reply, bodies)))


@pytest.fixture(scope="module")
def made(servers, tmp_path_factory):
    """Every lm-eval run of the module (`lmeval`: by name, LmevalRun, .ok() is its output folder) from two lm-eval
    processes, one starting with the generate run and one with the chat run; `evalpipe run arith` of the same
    documents (`lane`: a Future of the finished command, its run folder under `lane_out`) and the server's own chat
    replies (`replies`: a Future of chat_replies) on the off server, sent while lm-eval's first runs are under way: the
    server decodes them all in one batch, instead of four passes of one answer's length one after another."""
    root = tmp_path_factory.mktemp("lmeval")
    probe_tasks = root / "probe_tasks"  # a task of its own: three choices, acc only
    probe_tasks.mkdir()
    (probe_tasks / "mc.yaml").write_text(MC_PROBE_TASK)
    shutil.copy(TASKS / "evalpipe_lanes.py", probe_tasks)
    off, block = servers["off"].base + "/v1", servers["block"].base + "/v1"
    runs = {
        "off": lmeval_args(off, root / "off", limit=LIMIT, served=MODEL),
        "chat": lmeval_args(
            off,
            root / "chat",
            model="local-chat-completions",
            task="evalpipe_arith_chat",
            limit=CHAT_ITEMS,
            served=MODEL,
            extra=("--apply_chat_template",),
        ),
        "mc": lmeval_args(
            off,
            root / "mc",
            task="evalpipe_arith_mc",
            limit=MC_ITEMS,
            model_args="tokenizer_backend=remote",
            served=MODEL,
        ),
        "block": lmeval_args(block, root / "block", limit=LIMIT, served=MODEL),
        # lm-eval's own `dummy` model scores the choices at random, no server needed
        "probe": ["--model", "dummy", "--include_path", str(probe_tasks), "--tasks", "evalpipe_mc_probe"]
        + ["--limit", str(PROBE_ITEMS), "--output_path", str(root / "probe"), "--log_samples"],
    }
    with ThreadPoolExecutor(3) as pool:
        lane = pool.submit(run_lane, "arith", off, root / "evalpipe", "--num-examples", str(LIMIT), timeout=300)
        replies = pool.submit(chat_replies, off)
        # the chat run from a second lm-eval process beside the first: its documents decode in the off server's
        # batches with the generate run's too, instead of in a pass of their own after it; the block run follows it
        second = pool.submit(run_lmeval_batch, {name: runs.pop(name) for name in ("chat", "block")}, root / "second")
        lmeval = {**run_lmeval_batch(runs, root), **second.result()}
    return SimpleNamespace(lmeval=lmeval, lane=lane, lane_out=root / "evalpipe", replies=replies)


@pytest.fixture(scope="module")
def lmeval_runs(made):
    return made.lmeval


def samples_of(out, task="evalpipe_arith_gen"):
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def results_of(out):
    (path,) = out.rglob("results_*.json")
    return json.loads(path.read_text())


def test_lmeval_generate_score_and_texts_equal_evalpipe_run(made, lmeval_runs):
    r = made.lane.result()
    assert r.returncode == 0, r.stderr
    records, summary, _ = load_run(only_run_dir(made.lane_out, "arith"))
    ours = {rec["question_id"]: rec for rec in records}
    theirs = samples_of(lmeval_runs["off"].ok())
    assert sorted(s["doc_id"] for s in theirs) == sorted(ours) == list(range(LIMIT))
    for s in theirs:
        rec = ours[s["doc_id"]]
        assert s["arguments"]["gen_args_0"]["arg_0"] == rec["request"]["prompt"]
        assert s["resps"][0][0] == rec["response_text"], s["doc_id"]
        assert bool(s["exact_match"]) == rec["correct"], s["doc_id"]
    score = results_of(lmeval_runs["off"].ok())["results"]["evalpipe_arith_gen"]["exact_match,last-integer"]
    assert score == summary["accuracy"] == summary["n_correct"] / LIMIT
    assert 0 < summary["n_correct"] < LIMIT  # both outcomes occur, so the equality says something


def test_two_lmeval_runs_imported_audited_and_compared(lmeval_runs, tmp_path):
    runs = {}
    for arm in ("off", "block"):
        out = lmeval_runs[arm].ok()
        runs[arm] = tmp_path / arm
        r = run_cli("import", "lm-eval", out, "--out", runs[arm], "--arm", arm)
        assert r.returncode == 0, r.stderr
        assert f"imported {LIMIT} records of lm-eval/evalpipe_arith_gen" in r.stdout
        audit = run_cli("audit", runs[arm], "--no-progress")
        assert audit.returncode == 0, audit.stdout + audit.stderr
        assert "OK   grades" in audit.stdout and "not recorded by lm-eval: finish_reason" in audit.stdout
        records, summary, manifest = load_run(runs[arm])
        assert manifest["imported"]["tool"] == "lm-eval" and manifest["imported"]["version"] == "0.4.13"
        assert manifest["imported"]["model_args"]["model"] == MODEL and "usage" in manifest["imported"]["not_recorded"]
        samples = {s["doc_id"]: s for s in samples_of(out)}
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


def test_lmeval_chat_replies_are_the_servers_own_answers(made, lmeval_runs):
    out = lmeval_runs["chat"].ok()
    samples = sorted(samples_of(out, "evalpipe_arith_chat"), key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(CHAT_ITEMS))
    replies = made.replies.result()
    right = 0
    for sample in samples:
        text = replies[sample["doc"]["body"]]
        assert sample["resps"][0][0] == text, sample["doc_id"]
        numbers = re.findall(r"[0-9][0-9,]*", text)
        right += bool(numbers) and numbers[-1].replace(",", "") == sample["doc"]["expected_answer"]
    results = results_of(out)["results"]["evalpipe_arith_chat"]
    assert results["exact_match,last-integer"] == right / CHAT_ITEMS, results
    assert 0 < right < CHAT_ITEMS  # both outcomes occur, so the score equality says something


def test_lmeval_chat_run_imported_and_audited(lmeval_runs, tmp_path):
    out = lmeval_runs["chat"].ok()
    samples = samples_of(out, "evalpipe_arith_chat")
    assert len(samples) == CHAT_ITEMS and all(s["resps"][0][0].strip() for s in samples)
    (results_file,) = out.rglob("results_*.json")  # the results file itself names the run as well as its folder
    r = run_cli("import", "lm-eval", results_file, "--out", tmp_path / "run", "--arm", "chat")
    assert r.returncode == 0, r.stderr
    audit = run_cli("audit", tmp_path / "run", "--no-progress")
    assert audit.returncode == 0, audit.stdout
    records, summary, _ = load_run(tmp_path / "run")
    # the messages lm-eval sent, as it logged and hashed them
    bodies = {s["doc_id"]: s["doc"]["body"] for s in samples}
    for rec in records:
        (message,) = json.loads(rec["request"]["prompt"])
        assert message == {"role": "user", "content": bodies[rec["question_id"]]}, message
    assert summary["n_correct"] == sum(bool(s["exact_match"]) for s in samples)


def test_damaged_lmeval_output_is_named_with_its_line(lmeval_runs, tmp_path):
    def copy(name):
        dest = tmp_path / name
        shutil.copytree(lmeval_runs["off"].ok(), dest)
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
    shutil.copytree(lmeval_runs["off"].ok(), two / "x")
    shutil.copytree(lmeval_runs["block"].ok(), two / "y")
    refused(two, "holds 2 lm-eval runs", "import one results_*.json file")


def test_a_multiple_choice_run_is_imported_and_its_acc_re_derived(lmeval_runs, tmp_path):
    """A loglikelihood task's log (lm-eval's own `dummy` model scores the choices at random, no server needed): each
    document's response is its best-scoring choice, audit re-derives acc from the logged loglikelihoods."""
    out = lmeval_runs["probe"].ok()
    r = run_cli("import", "lm-eval", out, "--out", tmp_path / "run")
    assert r.returncode == 0, r.stderr
    records, summary, _ = load_run(tmp_path / "run")
    samples = {s["doc_id"]: s for s in samples_of(out, "evalpipe_mc_probe")}
    assert sorted(samples) == sorted(rec["question_id"] for rec in records) == list(range(PROBE_ITEMS))
    for rec in records:
        s = samples[rec["question_id"]]
        lls = [float(x[0]) for x in s["filtered_resps"]]
        assert rec["logprobs"]["choice_loglikelihoods"] == lls
        assert rec["extracted_answer"] == lls.index(max(lls)) and rec["correct"] == bool(s["acc"])
        assert rec["response_text"] == s["arguments"][f"gen_args_{rec['extracted_answer']}"]["arg_1"]
    assert 0 < summary["n_correct"] < PROBE_ITEMS  # random scores: both outcomes occur
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


def test_multiple_choice_scores_above_chance_with_the_models_own_loglikelihoods(lmeval_runs):
    out = lmeval_runs["mc"].ok()
    results = results_of(out)["results"]["evalpipe_arith_mc"]
    samples = samples_of(out, "evalpipe_arith_mc")
    assert len(samples) == MC_ITEMS
    # chance is 1/4: P(at least 8 of 10 right by chance) < 0.001
    assert results["acc,none"] >= 0.8, results
    for sample in samples:  # lm-eval's choice is the highest loglikelihood it got
        best = max(range(4), key=lambda k: float(sample["resps"][k][0][0]))
        assert sample["acc"] == float(best == sample["doc"]["gold"])
    runner = ModelRunner(MODEL, max_seqs=1, max_seq_len=2048)
    for sample in random.sample(samples, CHECKED_DOCS):
        for k, (resp,) in enumerate(sample["resps"]):
            args = sample["arguments"][f"gen_args_{k}"]
            context, continuation = TOK.encode(args["arg_0"]), TOK.encode(args["arg_1"])
            ids = context + continuation  # as lm-eval's remote tokenizer sent them: no BOS
            slot = runner.allocate()
            try:
                logp = torch.log_softmax(runner.forward([slot], [ids], all_logits=True).float(), dim=-1)
            finally:
                runner.free(slot)
            rows = logp[len(context) - 1 : len(ids) - 1]
            want = rows.gather(-1, torch.tensor(continuation).view(-1, 1)).sum().item()
            greedy = bool((rows.argmax(-1) == torch.tensor(continuation)).all())
            assert abs(float(resp[0]) - want) < 2e-3, (sample["doc_id"], k, resp, want)
            assert (resp[1] in (True, "True")) == greedy, (sample["doc_id"], k)
