"""Shared helpers of the speculative-decoding tests: prefill/plain-greedy/speculative loops straight on a runner."""

from __future__ import annotations

import torch

from evalpipe.engine.sampling import generator_for, sample, sampling_probs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence

TIE_MARGIN = 1e-4  # the oracle test's tie rule: a difference is a tie only if the reference's top-2 margin is below


def start(runner, prompts, params=None, seeds=None) -> list[Sequence]:
    """Allocate, prefill every prompt in one forward, take the first token with the engine's own sampler
    (greedy by default); seeds[i] seeds sequence i's generator on the runner's device."""
    params = params or SamplingParams(temperature=0.0, max_tokens=1 << 20)
    seqs = [Sequence(prompt=list(p), params=params) for p in prompts]
    device = getattr(runner, "device", "cpu")
    for i, s in enumerate(seqs):
        s.slot = runner.allocate()
        s.generator = generator_for(params, device)
        if seeds is not None and s.generator is not None:
            s.generator.manual_seed(seeds[i])
    logits = runner.forward([s.slot for s in seqs], [s.prompt for s in seqs])
    for s, row in zip(seqs, logits):
        s.output = [int(sample(sampling_probs(row, params), s.generator))]
    return seqs


def plain_greedy(runner, prompt, new_tokens) -> tuple[list[int], list[float]]:
    """Plain one-row greedy decoding; returns tokens and each step's top-2 logit margin (for the tie rule)."""
    seq = runner.allocate()
    try:
        logits = runner.forward([seq], [list(prompt)])
        tokens, margins = [], []
        while True:
            top2 = torch.topk(logits[0].double(), 2).values
            tokens.append(int(logits[0].argmax()))
            margins.append(float(top2[0] - top2[1]))
            if len(tokens) == new_tokens:
                return tokens, margins
            logits = runner.forward([seq], [[tokens[-1]]])
    finally:
        runner.free(seq)


def spec_generate(runner, decoder, prompts, new_tokens) -> list[Sequence]:
    """Speculative greedy decoding of all prompts as one batch until each has new_tokens tokens."""
    seqs = start(runner, prompts)
    active = list(seqs)
    while active:
        decoder.verify_step(active)
        active = [s for s in active if len(s.output) < new_tokens]
    return seqs


def finish(runner, decoder, seqs) -> None:
    for s in seqs:
        decoder.release(s.slot)
        runner.free(s.slot)


def compare_with_tie_rule(got: list[int], want: list[int], margins: list[float], label: str) -> str:
    """Token-for-token equality; a first difference is accepted only at a numerical tie of the reference."""
    assert len(got) == len(want) == len(margins), f"{label}: {len(got)} tokens against the reference's {len(want)}"
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None:
        return f"{label}: {len(want)}/{len(want)} tokens equal"
    msg = f"{label}: first difference at new token {first}, reference top-2 margin {margins[first]:.3g}"
    assert margins[first] < TIE_MARGIN, msg + f" (not a tie: bound {TIE_MARGIN})"
    return msg + " (numerical tie)"
