"""Keyed sampling (engine/keyed.py, sampling.keyed_sample) and sample-verify (spec/accept.py keyed_accept) on
tensors: the hash is the integer function it says it is, the noise of an output index does not depend on what is
drawn beside it, the draws are exact samples of the processed distribution (Pearson's chi-square goodness of fit
with a bound at the 1 - 1e-6 quantile), and sample-verify emits exactly the keyed samples of plain decoding."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2

from evalpipe.engine.keyed import SALT_FAULT, KeyedNoise, hash_bits, row_key
from evalpipe.engine.sampling import generator_for, keyed_sample, keyed_sample_rows, sample, sampling_probs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.spec.accept import keyed_accept, sample_verify

M32 = 0xFFFFFFFF
FALSE_ALARM = 1e-6  # the chi-square bound's probability of failing an exact sampler

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def py_fmix32(h: int) -> int:
    """MurmurHash3's fmix32 in plain Python integers: the reference the tensor version must equal bit for bit."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def py_hash(k1: int, k2: int, v: int) -> tuple[int, int]:
    h1 = py_fmix32(py_fmix32(v ^ k1) ^ k2)
    return h1, py_fmix32(py_fmix32(h1 ^ k1 ^ 0x6A09E667) ^ k2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_tensor_hash_equals_the_integer_reference_bit_for_bit(device):
    gen = torch.Generator().manual_seed(0)
    seeds = [0, 1, -1, 2**63 - 1, 2**64 + 5] + torch.randint(0, 2**62, (5,), generator=gen).tolist()
    keys = [row_key(s, i) for s in seeds for i in (0, 1, 4095)]
    vocab = 300
    h1, h2 = hash_bits(torch.tensor(keys, dtype=torch.int64, device=device), vocab)
    got = list(zip(h1.cpu().flatten().tolist(), h2.cpu().flatten().tolist()))
    want = [py_hash(k1, k2, v) for k1, k2 in keys for v in range(vocab)]
    assert got == want
    assert all(0 <= a <= M32 and 0 <= b <= M32 for a, b in got)
    assert len({a for a, _ in got[:vocab]}) == vocab  # one row: distinct ids, distinct hashes


def test_an_index_noise_depends_on_seed_index_and_id_alone():
    noise = KeyedNoise(1234)
    block = noise.exponentials(7, 6, 50, "cpu")
    for r in range(6):  # drawn alone, at the same output index
        assert torch.equal(noise.exponentials(7 + r, 1, 50, "cpu")[0], block[r])
    assert torch.equal(noise.exponentials(7, 6, 20, "cpu"), block[:, :20])  # a narrower vocabulary: the same ids
    assert not torch.equal(KeyedNoise(1235).exponentials(7, 6, 50, "cpu"), block)
    assert not torch.equal(noise.exponentials(7, 6, 50, "cpu", salt=SALT_FAULT), block)
    u = noise.uniforms(0, 64, 50, "cpu")
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0


def test_keyed_generator_needs_no_stream_and_draws_a_seed_when_none_is_given():
    assert generator_for(SamplingParams(temperature=0.0), keyed=True) is None
    assert generator_for(SamplingParams(seed=9), keyed=True).seed == 9
    drawn = {generator_for(SamplingParams(), keyed=True).seed for _ in range(4)}
    assert len(drawn) == 4 and all(0 <= s < 2**63 for s in drawn)


def keyed_counts(probs: torch.Tensor, seeds: int, indices: int) -> torch.Tensor:
    """Counts of the keyed draws of one distribution over seeds 0..seeds-1 and output indices 0..indices-1."""
    rows = probs.expand(indices, -1)
    draws = torch.cat([keyed_sample(rows, KeyedNoise(s), 0) for s in range(seeds)])
    return torch.bincount(draws, minlength=probs.shape[-1])


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's X^2 over the ids with p > 0, and the bound: the (1 - FALSE_ALARM) quantile of chi2(k - 1)."""
    support = probs > 0
    n = int(counts.sum())
    expected = probs[support].double() * n
    assert float(expected.min()) >= 5  # Cochran's rule for the chi-square approximation
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    return stat, float(chi2.ppf(1 - FALSE_ALARM, int(support.sum()) - 1))


NEG = float("-inf")
CASES = {  # name -> (logits, params): ties, masked (-inf) ids, and the truncations one after another
    "ties and -inf": ([2.0, 2.0, 1.0, 0.5, NEG, 0.5, -1.0, NEG], SamplingParams(temperature=1.0)),
    "top-k and top-p": ([3.0, 2.5, 2.5, 2.0, 1.0, 0.0, -2.0, NEG], SamplingParams(temperature=0.7, top_k=5, top_p=0.9)),
    "top-p then min-p": ([1.0, 0.9, 0.8, 0.7, 0.1, -0.5, -3.0, 0.8], SamplingParams(top_p=0.95, min_p=0.2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keyed_draws_are_exact_samples_of_the_processed_distribution(case):
    logits, params = CASES[case]
    probs = sampling_probs(torch.tensor(logits), params)
    counts = keyed_counts(probs, seeds=200, indices=100)  # 20,000 draws
    assert counts[probs == 0].sum() == 0, f"{case}: a masked or truncated id was drawn: {counts.tolist()}"
    stat, bound = chi_square(counts, probs)
    assert stat < bound, f"{case}: X^2 = {stat:.1f} >= {bound:.1f}; counts {counts.tolist()}, p {probs.tolist()}"
    # the same test can fail: a sampler off by 0.02 of mass moved between two ids is far above the bound
    wrong = probs.clone()
    top = int(probs.argmax())
    other = int(torch.nonzero(probs > 0).flatten()[-1])
    wrong[top] -= 0.02
    wrong[other] += 0.02
    assert chi_square(counts, wrong)[0] > bound


def test_sample_dispatches_on_the_noise_and_uses_the_index():
    probs = sampling_probs(torch.tensor(CASES["ties and -inf"][0]), SamplingParams())
    noise = KeyedNoise(5)
    rows = probs.expand(40, -1)
    per_index = [int(sample(probs, noise, i)) for i in range(40)]
    assert sample(rows, noise, 0).tolist() == per_index
    assert len(set(per_index)) > 1


def test_sample_verify_emits_the_keyed_samples_of_plain_decoding():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen) * 1.5
    p = sampling_probs(logits, SamplingParams(temperature=1.0, top_k=20))
    noise, start = KeyedNoise(77), 12
    plain = keyed_sample(p, noise, start).tolist()  # what plain decoding draws at indices 12..17
    for n_match in range(6):  # drafts equal to the first n_match samples, then a wrong one
        drafts = plain[:n_match] + [(plain[n_match] + 1) % 40] * (5 - n_match) if n_match < 5 else plain[:5]
        tokens, accepted = keyed_accept(p, drafts, noise, start)
        assert accepted == n_match
        assert tokens == plain[: n_match + 1]
    # the planted fault draws the token after a rejected draft from another key: it leaves the plain samples
    faulty = [
        keyed_accept(p, [(plain[0] + 1) % 40] * 5, KeyedNoise(s), start, residual_from_target=True)[0]
        for s in range(40)
    ]
    exact = [keyed_accept(p, [(plain[0] + 1) % 40] * 5, KeyedNoise(s), start)[0] for s in range(40)]
    assert sum(a != b for a, b in zip(faulty, exact)) > 10
    with pytest.raises(ValueError, match="G\\+1 target rows"):
        keyed_accept(p[:3], [1, 2, 3], noise, start)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_a_steps_rows_drawn_at_once_equal_each_row_drawn_alone(device):
    """engine/commit.py draws every keyed row of a step in one pass (keyed_sample_rows): rows of several requests
    with different transforms, seeds and output indices, interleaved, each equal to its own keyed_sample."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(24, 50, generator=gen) * 2).to(device)
    logits[5, :] = 0.0  # a row of ties
    logits[6, 10:] = float("-inf")  # masked ids
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_p=0.9),
        SamplingParams(temperature=1.2, top_k=5),
        SamplingParams(temperature=1.0, min_p=0.1),
    ]
    rows = [(r, params[r % 4], KeyedNoise(1000 + r % 3), 7 * r) for r in torch.randperm(24, generator=gen).tolist()]
    alone = [int(keyed_sample(sampling_probs(logits[r], p), noise, i)) for r, p, noise, i in rows]
    assert keyed_sample_rows(logits, rows) == alone
    assert keyed_sample_rows(logits, rows[:1]) == alone[:1]
    assert keyed_sample_rows(logits, []) == []
    assert set(keyed_sample_rows(logits, [(6, params[0], KeyedNoise(s), 0) for s in range(30)])) <= set(range(10))


def test_sample_verify_from_drawn_samples_equals_keyed_accept():
    gen = torch.Generator().manual_seed(4)
    p = sampling_probs(torch.randn(6, 30, generator=gen), SamplingParams(temperature=1.0))
    noise, start = KeyedNoise(9), 3
    samples = keyed_sample(p, noise, start).tolist()
    for n_match in range(6):
        drafts = samples[:n_match] + [(samples[n_match] + 1) % 30] * (5 - n_match) if n_match < 5 else samples[:5]
        assert sample_verify(samples, drafts) == keyed_accept(p, drafts, noise, start)
    assert sample_verify(samples[:1], []) == ([samples[0]], 0)  # no drafts: the sample alone
