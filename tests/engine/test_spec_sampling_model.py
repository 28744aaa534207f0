"""Speculative sampling on the real tiny model follows the target's distribution.

With a fixed context (prompt + one committed token), the first token a verify step emits must be distributed as the
target's next-token distribution after that context (temperature 1, top_k 12: the same transform for drafter and
target). 16 copies of the context run as one batch with their own seeds; after each verify step every copy is rolled
back to the context (target truncate + drafter rollback) and drafted again. Chi-square over the 12 kept tokens
(cells with expected count < 5 merged), fails when p < 1e-3. Deterministic (fixed seeds)."""

from __future__ import annotations

import numpy as np
import scipy.stats
import torch

from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling import sampling_probs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from tests.support.spec_helpers import start

BATCH = 16
ROUNDS = 100  # 1600 samples
P_THRESHOLD = 1e-3


def test_first_emitted_token_follows_the_target_distribution(capsys):
    runner = ModelRunner("evalpipe-tiny-dsv4", max_seqs=BATCH + 1, max_seq_len=128)
    params = SamplingParams(temperature=1.0, top_k=12, max_tokens=1 << 20)
    prompt = torch.randint(16, 272, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    committed = 300  # the context's last (pending) token, fixed for every copy

    probe = runner.allocate()
    want = sampling_probs(runner.forward([probe], [prompt + [committed]])[0], params).double().numpy()
    runner.free(probe)

    decoder = SpeculativeDecoder(runner, build_drafter("layerskip:3", runner), block_size=3)
    seqs = start(runner, [prompt] * BATCH, params, seeds=[1000 + i for i in range(BATCH)])
    counts = np.zeros(runner.config.vocab_size)
    for _ in range(ROUNDS):
        for s in seqs:
            s.output = [committed]
        for s, emitted in zip(seqs, decoder.verify_step(seqs)):
            counts[emitted[0]] += 1
            runner.truncate(s.slot, len(prompt))
            decoder.drafter.rollback(s, len(prompt), 0)
    accepted = sum(decoder.stats(s)["accepted_drafts"] for s in seqs)
    for s in seqs:
        decoder.release(s.slot)
        runner.free(s.slot)

    assert counts[want == 0].sum() == 0, "a token outside top_k was emitted"
    expected = want * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    p = float(scipy.stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue)
    with capsys.disabled():
        print(
            f"\nmodel-level speculative sampling: chi-square p = {p:.3f} over {int(counts.sum())} samples, "
            f"{accepted} drafts accepted of {BATCH * ROUNDS * 3}"
        )
    assert accepted > 0, "the test must exercise acceptance, not only rejection"
    assert p > P_THRESHOLD
