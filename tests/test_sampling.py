"""Sampling on tensors: the probability transform (temperature, top-k, top-p, min-p) and seeded draws."""

import math

import pytest
import torch

from evalpipe.engine.sampling import generator_for, sample, sampling_probs, token_logprobs
from evalpipe.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def test_greedy_is_one_hot_of_argmax_and_needs_no_generator():
    params = SamplingParams(temperature=0.0)
    probs = sampling_probs(LOGITS, params)
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert generator_for(params) is None
    assert int(sample(probs, None)) == 0


def test_temperature_scales_softmax():
    probs = sampling_probs(LOGITS, SamplingParams(temperature=0.5))
    expected = torch.softmax(LOGITS / 0.5, -1)
    assert torch.allclose(probs, expected, atol=1e-6)


def test_top_k_keeps_exactly_k_largest():
    probs = sampling_probs(LOGITS, SamplingParams(top_k=3))
    assert (probs > 0).tolist() == [True, True, True, False, False, False]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)
    expected = torch.softmax(LOGITS[:3], -1)
    assert torch.allclose(probs[:3], expected, atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_p():
    base = torch.softmax(LOGITS, -1)  # ~ [0.563, 0.207, 0.126, 0.076, 0.028, 0.004]
    p = float(base[0] + base[1]) - 1e-3  # the first two tokens are needed to reach p
    probs = sampling_probs(LOGITS, SamplingParams(top_p=p))
    assert (probs > 0).tolist() == [True, True, False, False, False, False]
    assert torch.allclose(probs[:2], base[:2] / base[:2].sum(), atol=1e-6)
    # a tiny top_p still keeps the most likely token
    assert (sampling_probs(LOGITS, SamplingParams(top_p=1e-6)) > 0).sum() == 1


def test_min_p_drops_tokens_below_fraction_of_max():
    base = torch.softmax(LOGITS, -1)
    probs = sampling_probs(LOGITS, SamplingParams(min_p=0.2))
    assert (probs > 0).tolist() == (base >= 0.2 * base.max()).tolist()


def test_transform_is_row_wise_on_matrices():
    rows = torch.stack([LOGITS, LOGITS.flip(0)])
    params = SamplingParams(top_k=2, temperature=0.7, top_p=0.9)
    both = sampling_probs(rows, params)
    assert torch.allclose(both[0], sampling_probs(rows[0], params))
    assert torch.allclose(both[1], sampling_probs(rows[1], params))


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, seed=1234)
    probs = sampling_probs(logits, params)
    a = [int(sample(probs[i], generator_for(params))) for i in range(64)]
    b = [int(sample(probs[i], generator_for(params))) for i in range(64)]
    assert a == b
    gen1, gen2 = generator_for(params), generator_for(SamplingParams(temperature=1.0, seed=99))
    assert sample(probs, gen1).tolist() != sample(probs, gen2).tolist()


def test_zero_probability_tokens_are_never_sampled():
    params = SamplingParams(top_k=2, seed=0)
    probs = sampling_probs(LOGITS, params)
    gen = generator_for(params)
    draws = {int(sample(probs, gen)) for _ in range(300)}
    assert draws == {0, 1}


def test_empirical_frequencies_match_probs():
    params = SamplingParams(temperature=1.0, seed=7)
    probs = sampling_probs(LOGITS, params)
    gen = generator_for(params)
    n = 20000
    counts = torch.bincount(sample(probs.expand(n, -1), gen), minlength=len(LOGITS)).float() / n
    # 4 standard errors of a binomial proportion at the largest p (~0.56) over 20000 draws is ~0.014
    assert torch.allclose(counts, probs, atol=0.015), (counts, probs)


def test_token_logprobs_are_raw_log_softmax():
    logits = torch.stack([LOGITS, LOGITS * 2])
    out = token_logprobs(logits, torch.tensor([1, 0]), top_k=2)
    ref = torch.log_softmax(logits, -1)
    assert out[0][0] == pytest.approx(float(ref[0, 1]))
    assert out[1][0] == pytest.approx(float(ref[1, 0]))
    assert [i for i, _ in out[0][1]] == [0, 1]
    assert token_logprobs(logits, torch.tensor([1, 0]), top_k=0)[0][1] == []


def test_sample_token_matches_the_two_step_path():
    from evalpipe.engine.sampling import sample_token

    greedy = SamplingParams(temperature=0.0)
    assert sample_token(LOGITS, greedy, None) == int(sample(sampling_probs(LOGITS, greedy), None)) == 0
    params = SamplingParams(temperature=0.8, top_k=4, seed=11)
    a = [sample_token(LOGITS, params, g) for g in [generator_for(params)] for _ in range(50)]
    gen = generator_for(params)
    b = [int(sample(sampling_probs(LOGITS, params), gen)) for _ in range(50)]
    assert a == b
