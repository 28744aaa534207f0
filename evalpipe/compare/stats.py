"""Paired statistics for two arms answering the same questions (eval-protocol section 4).

Greedy lanes pair responses question by question: exact McNemar on the discordant pairs, Tango's score
interval (intervals.py; valid at zero flips) for the verdict, a paired bootstrap over questions as a secondary
figure, and the smallest detectable drop with the questions the margin needs (power.py).
Repeated lanes pair by question only (repeat r shares no randomness across arms), so they get
per-question rates, a fixed-question and a question-clustered standard error, a t interval with Q - 1 degrees of
freedom for the verdict, and a permutation test that shuffles arm labels within each question.

Differences are always B - A: RUN_A is the reference (e.g. speculation off), RUN_B the candidate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
from scipy.stats import binomtest, fisher_exact, t

from evalpipe.compare import intervals, power

DEFAULT_RESAMPLES = 10_000
DEFAULT_SEED = 0
DEFAULT_CONFIDENCE = 0.95


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value: binomial test of min(b, c) out of b + c at 1/2."""
    if b + c == 0:
        return 1.0
    return float(binomtest(min(b, c), b + c, 0.5, alternative="two-sided").pvalue)


def percentile_interval(values: np.ndarray, confidence: float) -> tuple[float, float]:
    """Percentile interval with numpy's default linear interpolation (documented so tests can redo it)."""
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return float(lo), float(hi)


def paired_bootstrap_diff(
    correct_a: np.ndarray,
    correct_b: np.ndarray,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
    chunk: int = 1000,
) -> dict:
    """Bootstrap the accuracy difference B - A by resampling question ids with replacement.

    Resample r draws `rng.integers(0, n, size=n)` from `numpy.random.default_rng(seed)`; drawing the
    rows in blocks consumes the generator exactly as drawing them one by one would.
    """
    a = np.asarray(correct_a, dtype=np.float64)
    b = np.asarray(correct_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError("paired bootstrap needs two equal-length 1-D outcome vectors")
    n = a.size
    if n == 0:
        return {
            "n": 0,
            "diff": None,
            "ci_low": None,
            "ci_high": None,
            "n_resamples": n_resamples,
            "seed": seed,
            "confidence": confidence,
            "method": "paired bootstrap over questions, percentile",
        }
    d = b - a
    rng = np.random.default_rng(seed)
    diffs = np.empty(n_resamples, dtype=np.float64)
    done = 0
    while done < n_resamples:
        k = min(chunk, n_resamples - done)
        idx = rng.integers(0, n, size=(k, n))
        diffs[done : done + k] = d[idx].mean(axis=1)
        done += k
    lo, hi = percentile_interval(diffs, confidence)
    return {
        "n": int(n),
        "diff": float(d.mean()),
        "ci_low": lo,
        "ci_high": hi,
        "n_resamples": int(n_resamples),
        "seed": int(seed),
        "confidence": float(confidence),
        "method": "paired bootstrap over questions, percentile",
    }


def non_inferiority(ci_low: float | None, ci_high: float | None, margin_pts: float) -> str:
    """Judge B against A with margin `margin_pts` (accuracy points) by the interval's bounds.

    non-inferior: lower bound above -margin; inferior: upper bound below -margin; else inconclusive.
    A non-significant McNemar test is not evidence of equality, so only the interval decides.
    """
    if ci_low is None or ci_high is None:
        return "not-evaluable"
    margin = margin_pts / 100.0
    if ci_low > -margin:
        return "non-inferior"
    if ci_high < -margin:
        return "inferior"
    return "inconclusive"


@dataclass
class GreedyComparison:
    n: int
    n_correct_a: int
    n_correct_b: int
    both_right: int
    both_wrong: int
    b_only: int  # B right, A wrong ("gained")
    a_only: int  # A right, B wrong ("lost")
    diff: float
    mcnemar_p: float
    interval: dict  # the verdict's: intervals.paired_difference_interval
    bootstrap: dict  # secondary figure: collapses to [0, 0] with no flips
    margin_pts: float
    verdict: str
    planning_discordance: dict  # power.planning_discordance
    mde_pts: float | None
    n_needed_for_margin: int | None
    n_needed_if_no_flips: int | None
    # False when both arms got every question wrong: nothing could be lost, so the verdict says nothing
    informative: bool = True
    verdict_note: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def uninformative_reason(n: int, both_wrong: int) -> str | None:
    """Why a paired verdict carries no information about a difference, or None when it does.

    Both arms wrong everywhere: B cannot lose what A never had. Both right everywhere is informative: n right
    answers in B bound its loss rate (the interval says by how much)."""
    if n and both_wrong == n:
        return (
            f"both arms answered all {n} questions wrong: nothing could be lost, so this verdict carries no "
            "information (use a model that gets some right)"
        )
    return None


def compare_greedy(
    correct_a: np.ndarray,
    correct_b: np.ndarray,
    *,
    margin_pts: float,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
) -> GreedyComparison:
    a = np.asarray(correct_a, dtype=bool)
    b = np.asarray(correct_b, dtype=bool)
    b_only = int(np.sum(b & ~a))
    a_only = int(np.sum(a & ~b))
    n = int(a.size)
    boot = paired_bootstrap_diff(a, b, n_resamples=n_resamples, seed=seed, confidence=confidence)
    interval = intervals.paired_difference_interval(b_only, a_only, n, confidence)
    note = uninformative_reason(n, int(np.sum(~a & ~b)))
    plan = power.planning_discordance(b_only + a_only, n)
    mde = power.greedy_mde(n, plan["rate"])
    return GreedyComparison(
        n=n,
        n_correct_a=int(a.sum()),
        n_correct_b=int(b.sum()),
        both_right=int(np.sum(a & b)),
        both_wrong=int(np.sum(~a & ~b)),
        b_only=b_only,
        a_only=a_only,
        diff=float(b.mean() - a.mean()) if a.size else 0.0,
        mcnemar_p=mcnemar_exact(b_only, a_only),
        interval=interval,
        bootstrap=boot,
        margin_pts=float(margin_pts),
        verdict=non_inferiority(interval["low"], interval["high"], margin_pts) if note is None else "not-evaluable",
        planning_discordance=plan,
        mde_pts=None if mde is None else 100 * mde,
        n_needed_for_margin=power.greedy_n_needed(margin_pts / 100, plan["rate"]),
        n_needed_if_no_flips=power.n_for_no_flips(margin_pts / 100),
        informative=note is None,
        verdict_note=note,
    )


def fixed_question_se(outcomes_a: list[np.ndarray], outcomes_b: list[np.ndarray]) -> float:
    """SE of the mean per-question difference for *these* questions: sqrt(sum_i s2_a/n_a + s2_b/n_b) / Q.

    s2 is the within-question sample variance (ddof=1); a question with fewer than two responses in
    an arm contributes no variance from that arm.
    """
    q = len(outcomes_a)
    if q == 0:
        return float("nan")
    total = 0.0
    for oa, ob in zip(outcomes_a, outcomes_b):
        for o in (oa, ob):
            o = np.asarray(o, dtype=np.float64)
            if o.size >= 2:
                total += float(np.var(o, ddof=1)) / o.size
    return math.sqrt(total) / q


def clustered_se(per_question_diff: np.ndarray) -> float:
    """Question-clustered SE: sd(d_i, ddof=1) / sqrt(Q); generalises to new questions, so it is wider."""
    d = np.asarray(per_question_diff, dtype=np.float64)
    if d.size < 2:
        return float("nan")
    return float(np.std(d, ddof=1) / math.sqrt(d.size))


def within_question_permutation_test(
    outcomes_a: list[np.ndarray],
    outcomes_b: list[np.ndarray],
    *,
    n_permutations: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
) -> dict:
    """Two-sided permutation test of mean_i(p_b,i - p_a,i) shuffling arm labels within each question.

    Shuffling a question's pooled outcomes and re-splitting them n_a / n_b leaves arm B with a
    hypergeometric number of successes, so each permutation is one hypergeometric draw per question.
    p = (1 + #{|stat_perm| >= |stat_obs|}) / (1 + n_permutations).
    """
    na = np.array([len(o) for o in outcomes_a], dtype=np.int64)
    nb = np.array([len(o) for o in outcomes_b], dtype=np.int64)
    ka = np.array([int(np.sum(o)) for o in outcomes_a], dtype=np.int64)
    kb = np.array([int(np.sum(o)) for o in outcomes_b], dtype=np.int64)
    keep = (na > 0) & (nb > 0)
    na, nb, ka, kb = na[keep], nb[keep], ka[keep], kb[keep]
    if na.size == 0:
        return {"statistic": None, "p_value": None, "n_permutations": n_permutations, "seed": seed}
    observed = float(np.mean(kb / nb - ka / na))
    total = ka + kb
    rng = np.random.default_rng(seed)
    kb_perm = rng.hypergeometric(total, (na + nb) - total, nb, size=(n_permutations, na.size))
    ka_perm = total - kb_perm
    stats = np.mean(kb_perm / nb - ka_perm / na, axis=1)
    extreme = int(np.sum(np.abs(stats) >= abs(observed) - 1e-12))
    return {
        "statistic": observed,
        "p_value": (1 + extreme) / (1 + n_permutations),
        "n_permutations": int(n_permutations),
        "seed": int(seed),
        "method": "arm labels shuffled within question (hypergeometric draws)",
    }


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm step-down adjusted p-values (None stays None); a per-question flag, not the headline test."""
    idx = [i for i, p in enumerate(pvalues) if p is not None]
    order = sorted(idx, key=lambda i: pvalues[i])
    m = len(order)
    out: list[float | None] = [None] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def clustered_interval(
    diff: float | None, se: float, n_questions: int, margin_pts: float, confidence: float = DEFAULT_CONFIDENCE
) -> dict:
    """t interval (Q - 1 degrees of freedom) of a mean per-question difference from its question-clustered SE, and
    the non-inferiority verdict it gives (the greedy lanes' rule, `non_inferiority`, on this interval). With 30
    questions a normal quantile under-covers (Bowyer et al. 2025); the t quantile is the small-sample correction."""
    lo = hi = None
    if diff is not None and math.isfinite(se) and n_questions >= 2:
        q = float(t.ppf(0.5 + confidence / 2, n_questions - 1))
        lo, hi = diff - q * se, diff + q * se
    return {
        "ci_low": lo,
        "ci_high": hi,
        "confidence": confidence,
        "margin_pts": margin_pts,
        "df": n_questions - 1,
        "verdict": non_inferiority(lo, hi, margin_pts),
        "method": f"t with {n_questions - 1} df, question-clustered SE",
    }


def repeated_power(
    outcomes_a: list[np.ndarray], outcomes_b: list[np.ndarray], per_question_diff: np.ndarray, margin_pts: float
) -> dict:
    """MDE of a repeated comparison and the questions (or repeats) its margin needs (power.py's clustered model).

    within = mean over questions of s2_a + s2_b (per-response variances, ddof=1); between = max(0, var(d_i) -
    within / k). With no within-question variation observed, plan with the exact 95% upper bound u of the
    minority outcome's share over all responses: within = 2 u (1 - u), never 0."""
    q = len(outcomes_a)
    sizes = [o.size for o in outcomes_a + outcomes_b if o.size]
    if q < 2 or not sizes:
        return {"mde_pts": None, "questions_needed_for_margin": None, "repeats_needed_for_margin": None}
    k = max(1, round(float(np.mean(sizes))))
    var = [float(np.var(o, ddof=1)) if o.size >= 2 else 0.0 for o in outcomes_a + outcomes_b]
    within = 2 * float(np.mean(var))
    basis = "observed"
    if within == 0:
        total = int(sum(sizes))
        right = int(sum(float(o.sum()) for o in outcomes_a + outcomes_b))
        u = intervals.upper_bound_rate(min(right, total - right), total)
        within = 2 * u * (1 - u)
        basis = "exact one-sided 95% bound on the minority outcome (no within-question variation observed)"
    between = max(0.0, float(np.var(per_question_diff, ddof=1)) - within / k)
    mde = power.repeated_mde(q, k, within, between)
    margin = margin_pts / 100
    return {
        "repeats_per_question": k,
        "within_variance": within,
        "between_variance": between,
        "variance_basis": basis,
        "mde_pts": None if mde is None else 100 * mde,
        "questions_needed_for_margin": power.repeated_questions_needed(margin, k, within, between),
        "repeats_needed_for_margin": power.repeated_repeats_needed(margin, q, within, between),
    }


def compare_repeated(
    outcomes_a: dict[str, np.ndarray],
    outcomes_b: dict[str, np.ndarray],
    *,
    n_permutations: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    margin_pts: float = 1.0,
) -> dict:
    """Per-question success rates, their mean difference, both SEs, the clustered interval with its
    non-inferiority verdict at `margin_pts`, and the within-question permutation test."""
    ids = [q for q in outcomes_a if q in outcomes_b]
    oa = [np.asarray(outcomes_a[q], dtype=np.float64) for q in ids]
    ob = [np.asarray(outcomes_b[q], dtype=np.float64) for q in ids]
    pa = np.array([o.mean() if o.size else float("nan") for o in oa])
    pb = np.array([o.mean() if o.size else float("nan") for o in ob])
    d = pb - pa
    per_question = [
        {
            "question_id": q,
            "n_a": int(x.size),
            "n_b": int(y.size),
            "k_a": int(x.sum()),
            "k_b": int(y.sum()),
            "rate_a": float(ra),
            "rate_b": float(rb),
            "diff": float(rb - ra),
            "fisher_p": float(
                fisher_exact([[int(x.sum()), int(x.size - x.sum())], [int(y.sum()), int(y.size - y.sum())]])[1]
            )
            if x.size and y.size
            else None,
        }
        for q, x, y, ra, rb in zip(ids, oa, ob, pa, pb)
    ]
    for row, adj in zip(per_question, holm([r["fisher_p"] for r in per_question])):
        row["fisher_p_holm"] = adj
        row["flag"] = adj is not None and adj < 0.05
    diff, se = (float(np.nanmean(d)) if ids else None), clustered_se(d)
    total = sum(o.size for o in oa) + sum(o.size for o in ob)
    right = sum(float(o.sum()) for o in oa) + sum(float(o.sum()) for o in ob)
    note = None
    if total and right == 0:
        note = (
            "every response of both arms is wrong: the test carries no information about a difference "
            "(use a model that gets some right)"
        )
    pw = repeated_power(oa, ob, d, margin_pts)
    if se == 0 and pw.get("within_variance"):
        # every question's difference is the same (e.g. all right in both arms): sd(d_i) = 0 would make the interval
        # a point at any Q, so the SE comes from the planning variance (the exact bound on the minority outcome)
        interval = clustered_interval(
            diff,
            power.repeated_se(len(ids), pw["repeats_per_question"], pw["within_variance"], 0.0),
            len(ids),
            margin_pts,
        )
        interval["method"] += " (no variation observed: SE from the exact 95% bound on the minority outcome)"
    else:
        interval = clustered_interval(diff, se, len(ids), margin_pts)
    if note:
        interval["verdict"] = "not-evaluable"
    return {
        "informative": note is None,
        "note": note,
        "n_questions": len(ids),
        "n_responses_a": int(sum(o.size for o in oa)),
        "n_responses_b": int(sum(o.size for o in ob)),
        "mean_rate_a": float(np.nanmean(pa)) if ids else None,
        "mean_rate_b": float(np.nanmean(pb)) if ids else None,
        "diff": diff,
        "se_fixed_question": fixed_question_se(oa, ob),
        "se_clustered": se,
        "interval": interval,
        "power": pw,
        "permutation_test": within_question_permutation_test(oa, ob, n_permutations=n_permutations, seed=seed),
        "per_question": per_question,
    }


def bootstrap_ratio_of_medians(
    values_a: np.ndarray,
    values_b: np.ndarray,
    *,
    n_resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    confidence: float = DEFAULT_CONFIDENCE,
) -> dict:
    """median(B) / median(A) with an unpaired bootstrap interval (rounds of two benches are not paired).

    Each resample draws A's indices then B's indices from one `default_rng(seed)`.
    """
    a = np.asarray(values_a, dtype=np.float64)
    b = np.asarray(values_b, dtype=np.float64)
    if a.size == 0 or b.size == 0:
        return {"ratio": None, "ci_low": None, "ci_high": None, "n_a": int(a.size), "n_b": int(b.size)}
    rng = np.random.default_rng(seed)
    ia = rng.integers(0, a.size, size=(n_resamples, a.size))
    ib = rng.integers(0, b.size, size=(n_resamples, b.size))
    ratios = np.median(b[ib], axis=1) / np.median(a[ia], axis=1)
    lo, hi = percentile_interval(ratios, confidence)
    return {
        "median_a": float(np.median(a)),
        "median_b": float(np.median(b)),
        "ratio": float(np.median(b) / np.median(a)),
        "ci_low": lo,
        "ci_high": hi,
        "n_a": int(a.size),
        "n_b": int(b.size),
        "n_resamples": int(n_resamples),
        "seed": int(seed),
        "confidence": float(confidence),
        "method": "unpaired bootstrap of the ratio of medians, percentile",
    }
