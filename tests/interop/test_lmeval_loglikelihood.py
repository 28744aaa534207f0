"""lm-evaluation-harness for real against `evalpipe serve` (the default model): a multiple-choice (loglikelihood)
task through `local-completions` with the server's remote tokenizer, and a generate task through
`local-chat-completions`. The task YAMLs are the repository's (lm_eval_tasks/).

lm-eval lives in its own environment (tests/support/lmeval_env.py: where it is, and the skip or CI failure without it).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
from pathlib import Path

import openai
import pytest
import torch

from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.tokenizer import ByteTokenizer
from tests.support.lmeval_env import TASKS, require_lmeval
from tests.support.server_harness import ServerProcess

MODEL = "evalpipe-skills-dsv4"
TOK = ByteTokenizer()
MC_ITEMS = 10
CHECKED_DOCS = 3  # documents whose every choice is recomputed in this process (each forward costs a prefill)
CHAT_ITEMS = 3


@pytest.fixture(scope="module")
def server():
    require_lmeval()
    srv = ServerProcess(model=MODEL)
    yield srv
    assert srv.stop() == 0, srv.output()


def lm_eval(out: Path, task: str, model: str, model_args: str, limit: int, *extra: str) -> tuple[dict, list[dict]]:
    """Run lm_eval on one task with --log_samples; (its results for the task, its samples)."""
    cmd = [
        require_lmeval(),
        "--include_path",
        str(TASKS),
        "--tasks",
        task,
        "--model",
        model,
        "--model_args",
        model_args,
        "--limit",
        str(limit),
        "--log_samples",
        "--output_path",
        str(out),
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # lm-eval's own Python
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for f in out.rglob(f"samples_{task}_*.jsonl") for line in f.read_text().splitlines()]
    return results, samples


def test_multiple_choice_scores_above_chance_with_the_models_own_loglikelihoods(server, tmp_path):
    args = f"base_url={server.base}/v1/completions,model={MODEL},tokenizer_backend=remote"
    results, samples = lm_eval(tmp_path, "evalpipe_arith_mc", "local-completions", args, MC_ITEMS)
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


def test_chat_generate_matches_the_servers_own_answers(server, tmp_path):
    args = f"base_url={server.base}/v1/chat/completions,model={MODEL}"
    results, samples = lm_eval(
        tmp_path, "evalpipe_arith_chat", "local-chat-completions", args, CHAT_ITEMS, "--apply_chat_template"
    )
    assert len(samples) == CHAT_ITEMS
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    right = 0
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        doc = sample["doc"]
        reply = (
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": doc["body"]}],
                max_tokens=512,
                temperature=0,
                stop=["\n\n"],
            )
            .choices[0]
            .message.content
        )
        assert sample["resps"][0][0] == reply, sample["doc_id"]
        numbers = re.findall(r"[0-9][0-9,]*", reply)
        right += bool(numbers) and numbers[-1].replace(",", "") == doc["expected_answer"]
    assert results["exact_match,last-integer"] == right / CHAT_ITEMS, results
