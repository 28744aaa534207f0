"""`EngineConfig(deterministic=True)` on the CPU, built by `build` into the engine loop in process with the default
model: one prompt's greedy tokens are the same alone, in a batch of 8 with other prompts, after a prefix-cache hit on
its own first pages, and with block speculation (ngram) on, chunked prefill (48 rows a step) throughout.

What this proves: the switch reaches the model (`SiteSettings.deterministic`) through `build`, and the CPU serving
path keeps every arm's tokens equal with it on. It does not prove batch invariance on the GPU: the CPU path runs the
PyTorch references, and kernels/batch_invariant.py's aten overrides act on CUDA tensors only (the kernels' own
invariance is tests/kernels/'s; the GPU arms are benchmarks/serving/deterministic_gpu.py's)."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.build import build
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.loop import build_engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer

NEW_TOKENS = 12


def engine(**fields):
    config = EngineConfig(deterministic=True, max_batch=8, max_tokens_per_step=48, max_seq_len=512, **fields)
    return build_engine(config, build, lambda c: load_tokenizer(None))


def run(eng, prompts: list[list[int]]) -> list[Sequence]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(prompt=list(p), params=params) for p in prompts]
    eng.submit(seqs)
    while any(s.status is not Status.FINISHED for s in seqs):
        eng.step()
    return seqs


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh prompts every run
    lengths = [199] + torch.randint(20, 200, (7,), generator=gen).tolist()  # the first: two full pages of 64 and more
    return [[1] + torch.randint(2, 256, (int(n),), generator=gen).tolist() for n in lengths]


def test_greedy_tokens_depend_on_the_prompt_alone(prompts):
    target = prompts[0]
    plain = engine(prefix_cache="off")
    assert plain.runner.model.deterministic
    alone = run(plain, [target])[0].output
    assert len(alone) == NEW_TOKENS
    assert run(plain, [target] + prompts[1:])[0].output == alone  # a batch of 8

    cached = engine(prefix_cache="on")
    run(cached, [target[:150]])  # indexes the target's first two pages
    hit = run(cached, [target])[0]
    assert hit.cached_tokens == 128 and hit.output == alone

    spec = engine(prefix_cache="off", speculative="block", drafter="ngram")
    assert run(spec, [target])[0].output == alone
