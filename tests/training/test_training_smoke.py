"""The default model's training script runs end to end on the CPU (smoke mode: a few steps of every objective), and
what it writes is a checkpoint the engine serves with transformers' own logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_smoke_training_across_two_calls_writes_a_servable_checkpoint_receipt_and_curve(tmp_path):
    """The run is split as on the GPU machine: a first call stopped after its first step (`--stop-after 0`), then
    `--resume` finishes the same schedule with the first call's settings (a different one is refused); a finished
    run, or a folder without a receipt, refuses to be resumed."""
    out = tmp_path / "model"

    # one torch thread: beside another busy process on the 2-core machine, two threads spin against it (measured:
    # this test took 357 s with two threads and 76 s with one, beside one busy process)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(*extra):
        return subprocess.run(
            [sys.executable, "training/train_default_model.py", "--out", str(out), "--smoke", *extra],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
        )

    first = train("--stop-after", "0", "--lr", "0.003")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "2 planned steps left (--resume" in first.stdout
    partial = json.loads((out / "receipt.json").read_text())
    assert (partial["steps"], partial["planned_steps"], len(partial["calls"])) == (1, 3, 1)
    from training.curriculum import RECIPES

    assert partial["curriculum"] == json.loads(json.dumps(RECIPES["v3"].describe()))  # the default recipe, in full
    other = train("--resume", str(out), "--recipe", "v1")
    assert other.returncode != 0 and "trains recipe v3, not --recipe v1" in other.stderr

    changed = train("--resume", str(out), "--lr", "0.001")
    assert changed.returncode != 0 and "that run has --lr 0.003" in changed.stderr

    second = train("--resume", str(out))
    assert second.returncode == 0, second.stderr[-3000:]
    receipt = json.loads((out / "receipt.json").read_text())
    assert receipt["steps"] == 3 and receipt["tokens"] > partial["tokens"] and receipt["answer_tokens"] > 0
    assert [(c["first_step"], c["last_step"]) for c in receipt["calls"]] == [(0, 1), (1, 3)]
    assert receipt["wall_s"] > partial["wall_s"] and [h["step"] for h in receipt["history"]] == [0, 2]
    assert len(receipt["evals"]) == 2 and "--resume" in receipt["calls"][1]["command"]
    # the resumed call trains the run's settings, not the defaults of flags it did not repeat
    assert receipt["calls"][1]["args"]["lr"] == 0.003 and "given" not in receipt["calls"][1]["args"]

    again = train("--resume", str(out))
    assert again.returncode != 0 and "nothing to resume" in again.stderr
    elsewhere = train("--resume", str(tmp_path))
    assert elsewhere.returncode != 0 and "no receipt.json there" in elsewhere.stderr
    assert {"torch", "transformers", "python"} <= set(receipt["packages"]) and receipt["device"]
    losses = [h["loss"] for h in receipt["history"]]
    assert all(x == x and 0 < x < 20 for x in losses)  # finite, sane
    assert {"exit3", "exit4", "kl", "prompt"} <= set(receipt["history"][0])
    assert (out / "loss.png").stat().st_size > 10_000 and (out / "config.json").is_file()

    from transformers import DeepseekV4ForCausalLM

    from evalpipe.engine.runner import ModelRunner

    oracle = DeepseekV4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    config = json.loads((REPO / "training" / "default_model_config.json").read_text())
    assert oracle.config.num_hidden_layers == config["num_hidden_layers"]
    assert any(int(t.sum()) for name, t in oracle.state_dict().items() if name.endswith("tid2eid"))  # hash table set
    runner = ModelRunner(str(out), max_seqs=1, max_seq_len=256)
    prompt = torch.randint(16, 272, (90,), generator=torch.Generator().manual_seed(0)).tolist()
    seq = runner.allocate()
    got = runner.forward([seq], [prompt], all_logits=True)
    with torch.no_grad():
        want = oracle(torch.tensor([prompt])).logits[0]
    assert float((got - want).abs().max()) < 1e-4
