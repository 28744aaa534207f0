"""Acceptance math of block speculation, at tensor level (no model).

Distribution test: a toy target and a toy drafter are first-order Markov chains over a tiny vocabulary, so the exact
law of the first K generated tokens is known in closed form. Speculative sampling (draft G tokens from the drafter,
accept/reject with `rejection_accept`, repeat) must reproduce that law. Chi-square goodness of fit over all V**K
sequences, fixed seeds; the test fails when p < P_THRESHOLD = 1e-3 (a correct sampler fails a given seed with
probability 0.1%; the seeds are fixed, so the result is deterministic). A negative control (accept every draft)
proves that the test can tell a wrong sampler apart at this sample size.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import scipy.stats
import torch

from evalpipe.engine.sampling import sampling_probs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.spec.accept import (
    SimulatedAcceptLengths,
    SpecStats,
    greedy_accept,
    in_top_k,
    rejection_accept,
    simulated_accept,
    threshold_accept,
    topk_accept,
)
from evalpipe.engine.spec.settings import AcceptRule

V = 5  # vocabulary
K = 3  # tokens per generated sequence whose joint law is tested
# Sequences per chi-square test. At 3000 the seeded correct samplers give p = 0.014 (plain), 0.87, 0.19, 0.64
# (one-hot) and 0.84 (SGLang 1.0/1.0); the controls reject far past the 1e-3 bound: accept-all has noncentrality
# 3000 * sum((q - p)^2 / p) = 3.8e5 against the critical value 178 of chi2(124), and SGLang at 0.3 gives a statistic of
# 701 (p = 2.6e-81).
SAMPLES = 3000
P_THRESHOLD = 1e-3


def _chain(seed: int, **sampling) -> torch.Tensor:
    """Row-stochastic [V, V] transition matrix: random logits through the engine's own sampling transform
    (`sampling_probs`: temperature, top-k, top-p), so zeros appear exactly where the sampler puts them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=g) * 1.5
    probs = sampling_probs(logits, SamplingParams(**sampling)).to(torch.float64)
    return probs / probs.sum(dim=-1, keepdim=True)


def _exact_law(target: torch.Tensor, start: int) -> np.ndarray:
    law = np.zeros([V] * K)
    for seq in itertools.product(range(V), repeat=K):
        prob, prev = 1.0, start
        for t in seq:
            prob *= float(target[prev, t])
            prev = t
        law[seq] = prob
    return law.reshape(-1)


def _speculative_sequences(target, draft, block, seed, accept=rejection_accept) -> np.ndarray:
    """Generate SAMPLES sequences of K tokens by block speculation; return counts over the V**K cells."""
    g = torch.Generator().manual_seed(seed)
    counts = np.zeros(V**K, dtype=np.int64)
    for _ in range(SAMPLES):
        out, prev = [], 0
        while len(out) < K:
            drafts, q_rows, cur = [], [], prev
            for _ in range(block):
                cur = int(torch.multinomial(draft[cur], 1, generator=g))
                q_rows.append(draft[drafts[-1] if drafts else prev])
                drafts.append(cur)
            contexts = [prev] + drafts
            p_rows = torch.stack([target[c] for c in contexts])
            emitted, _ = accept(p_rows, torch.stack(q_rows), drafts, g)
            out += emitted
            prev = out[-1]
        counts[int(np.ravel_multi_index(out[:K], [V] * K))] += 1
    return counts


def _chi_square_p(counts: np.ndarray, law: np.ndarray) -> float:
    support = law > 0
    assert counts[~support].sum() == 0, "a sequence of zero target probability was generated"
    expected = law[support] / law[support].sum() * counts.sum()
    return float(scipy.stats.chisquare(counts[support], expected).pvalue)


@pytest.mark.parametrize(
    "label,block,filters",
    [
        ("plain T=1", 3, {}),
        ("T=0.7 top_k=3", 2, {"temperature": 0.7, "top_k": 3}),
        ("top_p=0.8", 4, {"top_p": 0.8}),
    ],
)
def test_speculative_sampling_matches_target_law(label, block, filters):
    target = _chain(1, **filters)
    draft = _chain(2, **filters)  # same transform applied to the drafter's distribution
    law = _exact_law(target, start=0)
    counts = _speculative_sequences(target, draft, block, seed=1234)
    p = _chi_square_p(counts, law)
    print(f"{label}: chi-square p = {p:.4f} over {SAMPLES} sequences of {K} tokens")
    assert p > P_THRESHOLD, f"{label}: speculative samples do not follow the target law (p={p:.2e})"


def test_one_hot_drafter_matches_target_law():
    """A drafter without a distribution (n-gram lookup) passes q = one-hot of its proposal."""
    target = _chain(3)
    proposal = torch.eye(V, dtype=torch.float64)[[1, 2, 3, 4, 0]]  # deterministic "next token" table
    counts = _speculative_sequences(target, proposal, 3, seed=99)
    p = _chi_square_p(counts, _exact_law(target, start=0))
    assert p > P_THRESHOLD, f"one-hot drafter: p={p:.2e}"


def test_chi_square_rejects_a_wrong_sampler():
    """Negative control: accepting every draft samples the drafter's law, which the test must reject."""

    def accept_all(p_rows, q_rows, drafts, g):
        return list(drafts) + [int(torch.multinomial(p_rows[-1], 1, generator=g))], len(drafts)

    target, draft = _chain(1), _chain(2)
    counts = _speculative_sequences(target, draft, 3, seed=1234, accept=accept_all)
    assert _chi_square_p(counts, _exact_law(target, start=0)) < P_THRESHOLD


def test_greedy_accept_longest_prefix_plus_bonus():
    logits = torch.full((4, 6), -1.0)
    for row, tok in enumerate([2, 5, 1, 3]):  # target argmax per row
        logits[row, tok] = 1.0
    assert greedy_accept(logits, [2, 5, 1]) == ([2, 5, 1, 3], 3)
    assert greedy_accept(logits, [2, 5, 0]) == ([2, 5, 1], 2)
    assert greedy_accept(logits, [4, 5, 1]) == ([2], 0)
    tie = torch.zeros(1, 6)
    assert greedy_accept(tie, []) == ([0], 0)  # ties go to the lowest id, as torch.argmax in plain decoding


def test_rejection_accept_certain_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert rejection_accept(p, torch.tensor([[0.0, 1.0, 0.0]]), [1], g) == ([1, 2], 1)  # p/q = 1: always kept
    assert rejection_accept(p, torch.tensor([[1.0, 0.0, 0.0]]), [0], g) == ([1], 0)  # p(d) = 0: always replaced
    with pytest.raises(ValueError):
        rejection_accept(p, p, [1], g)


@pytest.mark.parametrize("mean,block", [(5.5, 5), (3.3, 5), (1.0, 5), (6.0, 5), (2.71, 9)])
def test_simulated_acceptance_realised_mean(mean, block):
    sim = SimulatedAcceptLengths(mean, block)
    lengths = [sim.next_length() for _ in range(1000)]
    assert set(lengths) <= {int(np.floor(mean)), int(np.ceil(mean))}
    assert all(1 <= n <= block + 1 for n in lengths)
    assert abs(np.mean(lengths) - mean) <= 0.02


def test_simulated_acceptance_rejects_impossible_means():
    for bad in (0.5, 6.5):
        with pytest.raises(ValueError):
            SimulatedAcceptLengths(bad, 5)


def test_simulated_accept_commits_drafts_then_target_token():
    target = [9, 8, 7, 6]
    assert simulated_accept([1, 2, 3], 3, target.__getitem__) == ([1, 2, 7], 2)
    assert simulated_accept([1, 2, 3], 1, target.__getitem__) == ([9], 0)
    assert simulated_accept([1, 2], 6, target.__getitem__) == ([1, 2, 7], 2)  # capped at the drafts available


def test_spec_stats_consistency():
    stats = SpecStats(block_size=3)
    for accepted in [0, 3, 1, 1, 2]:
        stats.record(accepted)
    d = stats.to_dict(completion_tokens=13)
    assert d["verify_steps"] == sum(d["accept_histogram"]) == 5
    assert d["accepted_drafts"] == sum(i * h for i, h in enumerate(d["accept_histogram"])) == 7
    assert d["draft_tokens"] == 15
    assert d["accept_length"] == pytest.approx(13 / 5)
    assert SpecStats(block_size=2).to_dict(completion_tokens=1)["accept_length"] is None


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    from evalpipe.engine.spec.drafters import NgramDrafter

    d = NgramDrafter(max_ngram=3)
    assert d.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # suffix [1, 2] seen at 0
    assert d.lookup([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # longest suffix [2, 3]
    assert d.lookup([7, 1, 7, 2, 7], 2) == [2, 7]  # the latest earlier occurrence of [7] wins
    assert d.lookup([3, 1, 3], 3) == [1, 3, 1]  # keeps extending on its own proposal
    assert d.lookup([5, 6, 7], 4) == [7, 7, 7, 7]  # no match: repeat the last token


# ----------------------------------------------------------------------------------------- lossy rules


def _ranked_logits(rankings: list[list[int]], vocab: int = 6) -> torch.Tensor:
    """[len(rankings), vocab] logits where row i orders its tokens as rankings[i] (best first) by clear gaps."""
    logits = torch.full((len(rankings), vocab), -10.0)
    for row, order in enumerate(rankings):
        for rank, tok in enumerate(order):
            logits[row, tok] = 5.0 - rank
    return logits


def test_topk_accepts_second_best_drafts_that_the_exact_rule_rejects():
    # each draft is the target's 2nd-best token at its row; the bonus row's best is 4
    logits = _ranked_logits([[2, 1, 0], [3, 5, 0], [0, 4, 1], [4, 1, 2]])
    drafts = [1, 5, 4]
    assert greedy_accept(logits, drafts) == ([2], 0)  # exact greedy: the first draft already fails
    assert topk_accept(logits, drafts, 2) == ([1, 5, 4, 4], 3)  # all three kept, then the target argmax
    assert topk_accept(logits, drafts, 3) == ([1, 5, 4, 4], 3)
    third_best = [1, 0, 4]  # row 1: 0 is 3rd best
    assert topk_accept(logits, third_best, 2) == ([1, 3], 1)  # rejected at row 1: the bonus is row 1's argmax
    assert topk_accept(logits, third_best, 3) == ([1, 0, 4, 4], 3)
    tie = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0]])
    assert in_top_k(tie, [3], 1) == [True]  # ties count for the draft
    probs = torch.tensor([[0.6, 0.4, 0.0, 0.0]])
    assert in_top_k(probs, [2], 3) == [True]
    assert in_top_k(probs, [2], 3, require_positive=True) == [False]  # filtered out by the request: never kept


def test_topk_with_k1_is_exact_greedy_and_the_rule_refuses_it():
    """K=1 (no ties) is exactly greedy acceptance, which is why AcceptRule refuses it as a 'lossy' setting."""
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        logits = torch.randn(5, 9, generator=g)
        m = int(torch.randint(0, 5, (1,), generator=g))  # the first m drafts are the target's own argmax
        drafts = logits.argmax(-1)[:m].tolist() + torch.randint(0, 9, (4 - m,), generator=g).tolist()
        assert topk_accept(logits, drafts, 1) == greedy_accept(logits, drafts)
    with pytest.raises(ValueError, match="K >= 2"):
        AcceptRule(topk=1)


def test_accept_rule_settings_and_reports():
    assert AcceptRule.from_flags(None, None, None).describe() == {"rule": "exact", "lossy": False}
    assert AcceptRule.from_flags(None, 1.0, 1.0).name == "exact"  # SGLang's lossless default stays exact
    topk = AcceptRule.from_flags(3, None, None)
    assert topk.describe()["rule"] == "topk" and topk.describe()["k"] == 3 and topk.lossy
    assert topk.lossy_for(greedy=True) and topk.lossy_for(greedy=False)
    thr = AcceptRule.from_flags(None, 0.4, None)
    assert thr.describe()["threshold_single"] == 0.4 and thr.describe()["threshold_acc"] == 1.0 and thr.lossy
    assert not thr.lossy_for(greedy=True) and thr.lossy_for(greedy=False)
    for bad in (dict(threshold_single=1.5), dict(threshold_acc=-0.1), dict(topk=3, threshold_acc=0.5)):
        with pytest.raises(ValueError):
            AcceptRule(**bad)


def test_topk_under_sampling_keeps_a_top_k_draft_the_exact_test_would_replace():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q = torch.tensor([[0.0, 0.01, 0.99, 0.0]], dtype=torch.float64)  # draft 2: p/q = 0.2 / 0.99
    kept = exact_kept = 0
    for seed in range(200):
        lossy = rejection_accept(
            p, q, [2], torch.Generator().manual_seed(seed), keep=in_top_k(p[:1], [2], 3, require_positive=True)
        )
        exact = rejection_accept(p, q, [2], torch.Generator().manual_seed(seed))
        kept += lossy[1]
        exact_kept += exact[1]
    assert kept == 200  # 3rd best of row 0 with K=3: always kept
    assert 20 < exact_kept < 70  # the exact test keeps it with probability 0.2 / 0.99


def test_threshold_single_and_acc_follow_sglangs_test():
    p = torch.tensor([[0.4, 0.35, 0.25], [0.1, 0.1, 0.8]], dtype=torch.float64)
    for seed in range(50):  # p(d) = 0.35 >= threshold_single 0.3: accepted without a coin
        assert threshold_accept(p, [1], 0.3, 1.0, torch.Generator().manual_seed(seed))[1] == 1
    n = 4000
    for acc, want in ((1.0, 0.35), (0.7, 0.5), (0.35, 1.0)):  # acceptance probability min(1, p(d) / acc)
        got = sum(threshold_accept(p, [1], 1.0, acc, torch.Generator().manual_seed(s))[1] for s in range(n)) / n
        assert abs(got - want) < 0.03, (acc, got)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # after a rejection the token comes from p without the rejected draft
        tokens, accepted = threshold_accept(p, [1], 1.0, 1.0, g)
        assert accepted == 1 or tokens[0] != 1


def _sglang_rule(single, acc):
    def accept(p_rows, q_rows, drafts, g):
        return threshold_accept(p_rows, drafts, single, acc, g)

    return accept


def test_threshold_rule_at_one_follows_the_target_law_and_below_one_does_not():
    """SGLang's target-only rule is exact at 1.0/1.0 whatever the drafter samples; at 0.3 the chi-square test
    sees the drafter's tokens leak into the output."""
    target, draft = _chain(1), _chain(2)
    law = _exact_law(target, start=0)
    exact = _chi_square_p(_speculative_sequences(target, draft, 3, seed=1234, accept=_sglang_rule(1.0, 1.0)), law)
    lossy = _chi_square_p(_speculative_sequences(target, draft, 3, seed=1234, accept=_sglang_rule(0.3, 1.0)), law)
    print(f"SGLang target-only rule: chi-square p = {exact:.4f} at thresholds 1.0, {lossy:.2e} at single 0.3")
    assert exact > P_THRESHOLD
    assert lossy < P_THRESHOLD
