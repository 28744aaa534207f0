"""Seeded replay in the engine loop (`EngineConfig(deterministic=True)`, built by `build` with the default model,
chunked prefill, the CPU): a seeded T = 1 request's tokens are the same with speculation off, with block speculation
through layerskip:4, the n-gram drafter and `self`, alone and in a batch of 8 -- sample-verify emits the keyed sample
plain decoding draws at each output index. Without keyed sampling (the stream sampler) speculation changes the
tokens: the negative control. The planted faults that act on sampled verification (`residual-from-target`,
`greedy-sampling`) leave the spec-off tokens at once: the first differing (request, token) is reported."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.build import build
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.loop import build_engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer

NEW_TOKENS = 16
REQUESTS = 8
SEEDS = [1000 + i for i in range(REQUESTS)]


def engine(deterministic: bool = True, **fields):
    config = EngineConfig(
        deterministic=deterministic, max_batch=8, max_tokens_per_step=64, max_seq_len=512, prefix_cache="off", **fields
    )
    return build_engine(config, build, lambda c: load_tokenizer(None))


def run(eng, prompts, seeds) -> list[Sequence]:
    seqs = [
        Sequence(prompt=list(p), params=SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=s, ignore_eos=True))
        for p, s in zip(prompts, seeds)
    ]
    eng.submit(seqs)
    while any(s.status is not Status.FINISHED for s in seqs):
        eng.step()
    return seqs


def first_difference(got: list[list[int]], want: list[list[int]]) -> tuple[int, int] | None:
    """(request, token index) of the first differing token, requests in order; None when all are equal."""
    for r, (a, b) in enumerate(zip(got, want)):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        if i is not None:
            return r, i
    return None


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(46)
    out = [
        [1] + torch.randint(2, 256, (int(n),), generator=gen).tolist()
        for n in torch.randint(8, 60, (REQUESTS,), generator=gen)
    ]
    out[0][20:] = out[0][2:20] * 3  # a repeated span: the n-gram drafter finds matches
    return out


@pytest.fixture(scope="module")
def spec_off(prompts):
    return [s.output for s in run(engine(), prompts, SEEDS)]


@pytest.mark.parametrize("drafter", ["layerskip:4", "ngram", "self"])
def test_seeded_sampling_with_speculation_equals_speculation_off(prompts, spec_off, drafter, capsys):
    eng = engine(speculative="block", drafter=drafter)
    seqs = run(eng, prompts, SEEDS)
    assert first_difference([s.output for s in seqs], spec_off) is None
    hist = [sum(h) for h in zip(*(eng.decoder.stats(s)["accept_histogram"] for s in seqs))]
    if drafter == "self":  # the target's own distribution and key: every draft is the target's sample
        assert sum(hist[:-1]) == 0, hist
    else:  # both accepted drafts and rejections were exercised
        assert sum(hist[1:]) > 0 and sum(hist[:-1]) > 0, hist
    with capsys.disabled():
        print(f"\n{drafter}: {REQUESTS} x {NEW_TOKENS} tokens identical to spec off; accepted-drafts histogram {hist}")


def test_a_seeded_request_alone_equals_it_in_a_batch_of_eight(prompts, spec_off):
    eng = engine(speculative="block", drafter="layerskip:4")
    assert run(eng, [prompts[0]], [SEEDS[0]])[0].output == spec_off[0]


def test_the_stream_sampler_does_not_replay_under_speculation(prompts, spec_off):
    off = [s.output for s in run(engine(deterministic=False), prompts, SEEDS)]
    on = [
        s.output for s in run(engine(deterministic=False, speculative="block", drafter="layerskip:4"), prompts, SEEDS)
    ]
    assert first_difference(on, off) is not None  # the control: what keyed sampling changes


@pytest.mark.parametrize("fault", ["residual-from-target", "greedy-sampling"])
def test_a_sampled_verify_fault_breaks_seeded_replay_at_once(prompts, spec_off, fault, capsys):
    seqs = run(engine(speculative="block", drafter="layerskip:4", debug_faults=(fault,)), prompts, SEEDS)
    where = first_difference([s.output for s in seqs], spec_off)
    assert where is not None, f"{fault}: {REQUESTS} seeded requests equal to spec off"
    with capsys.disabled():
        print(f"\n{fault} (layerskip:4): first divergence at request {where[0]}, output token {where[1]}")
