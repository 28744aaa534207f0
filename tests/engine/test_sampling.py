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


def test_step_argmax_reads_every_row_once_and_matches_sample_token():
    """The engine's one host read per step gives each row's greedy token exactly as `sample_token` does, ties to
    the lowest id, NaN-free and -inf rows included; later calls reuse the same read."""
    from evalpipe.engine.sampling import StepArgmax, sample_token

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, ())))  # fresh inputs every run
    logits = torch.randn(7, 50, generator=gen)
    logits[2, [3, 9, 40]] = 9.0  # a three-way tie: the lowest id wins
    logits[4] = float("-inf")
    logits[4, 17] = -1e30
    logits[5, :] = 0.0  # all tied
    greedy = SamplingParams(temperature=0.0)
    step = StepArgmax(logits)
    assert step.rows(2, 3) == [3] and step.rows(5, 6) == [0] and step.rows(4, 5) == [17]
    first = step._ids
    assert step.rows(0, 7) == [sample_token(row, greedy, None) for row in logits]
    assert step._ids is first  # one transfer for the whole step
    assert step.rows(7, 7) == []


def test_seq_event_then_concatenates_a_lagging_reader_s_events():
    """Two queued events of one sequence merge into the one chunk a lagging HTTP reader sends: tokens, text and
    logprobs concatenated in order, the rest (finish, counts, spec) from the later event."""
    from evalpipe.engine.ipc import SeqEvent

    a = SeqEvent(index=1, token_ids=[5, 6], text="ab", logprobs=None, completion_tokens=2, cached_tokens=64)
    b = SeqEvent(
        index=1,
        token_ids=[7],
        text="c",
        logprobs=[{"id": 7, "logprob": -0.1, "top": []}],
        completion_tokens=3,
        finish_reason="length",
        spec={"accept_length": 2.0},
        cached_tokens=64,
    )
    m = a.then(b)
    assert (m.token_ids, m.text, m.completion_tokens, m.finish_reason) == ([5, 6, 7], "abc", 3, "length")
    assert m.logprobs == b.logprobs and m.spec == b.spec and m.index == 1 and m.cached_tokens == 64
    assert a.then(SeqEvent(index=1, token_ids=[], text="", logprobs=None, completion_tokens=2)).logprobs is None
    assert (a.token_ids, a.text) == ([5, 6], "ab")  # the inputs are left as they were
