"""The smallest detectable difference (MDE) of a comparison, and the sample size a margin needs.

The MDE of a design is the smallest margin its (1 - alpha) interval excludes with probability `power` when the
arms are truly equal; the questions a margin needs are the fewest whose MDE reaches it. Under a normal
approximation both read (z_{1-alpha/2} + z_{power}) * se, which is also the drop a two-sided level-alpha test
detects with that power (Connor 1987, Biometrics 43:207-211: se = sqrt(psi / n) for paired 0/1 outcomes at
discordance psi, its conservative form without the -d^2 term).

- Greedy lanes: exact over the binomial distribution of flip tables (flips ~ Binomial(n, psi), gained | flips ~
  Binomial(flips, 1/2)), each judged by the verdict's own rule, Tango's interval; the normal form under-states
  what few expected flips need, and is used only beyond MANY_FLIPS expected flips. With zero flips Tango's bounds are
  +-z^2 / (n + z^2), so a margin M needs
  n > z^2 (1 - M) / M even then (381 questions for 1 point). With no discordant pair observed, plan with the exact
  one-sided 95% upper bound on psi (`intervals.upper_bound_rate`), never with 0.
- Repeated lanes (Q questions x k responses, clustered by question): se = sqrt((between + within / k) / Q), where
  `within` is the per-response outcome variance of both arms summed and `between` the variance of the true
  per-question differences; t quantiles with Q - 1 degrees of freedom.
- Bench throughput: the ratio of medians on the log scale, se(log median) ~ 1.2533 sd(log x) / sqrt(n) (the
  median's asymptotic efficiency against the mean under normality, sqrt(pi / 2)).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import binom, norm, t

from evalpipe.compare.intervals import tango_interval, upper_bound_rate, z_quantile

ALPHA = 0.05
POWER = 0.80
MEDIAN_SE_FACTOR = math.sqrt(math.pi / 2)


def z_sum(alpha: float = ALPHA, power: float = POWER) -> float:
    return z_quantile(1 - alpha) + float(norm.ppf(power))


def t_sum(df: int, alpha: float = ALPHA, power: float = POWER) -> float:
    return float(t.ppf(1 - alpha / 2, df) + t.ppf(power, df))


# ----------------------------------------------------------------------------- greedy (paired 0/1)


def planning_discordance(discordant: int, n: int, confidence: float = 0.95) -> dict:
    """The discordance rate to plan with: the observed one, or its exact upper bound when none was observed."""
    if n <= 0:
        return {"rate": None, "basis": "no pairs"}
    if discordant > 0:
        return {"rate": discordant / n, "basis": "observed"}
    return {
        "rate": upper_bound_rate(0, n, confidence),
        "basis": f"exact one-sided {confidence:.0%} upper bound (no discordant pair observed)",
    }


def n_for_no_flips(margin: float, alpha: float = ALPHA) -> int | None:
    """Fewest pairs whose zero-flip Tango interval, +-z^2 / (n + z^2), excludes -margin (margin a proportion)."""
    if not 0 < margin < 1:
        return None
    z2 = z_quantile(1 - alpha) ** 2
    return math.floor(z2 * (1 - margin) / margin) + 1


MANY_FLIPS = 1000  # expected flips beyond which the normal form is used: it is then within ~1% and the tables many


def equal_arm_lower_bounds(n: int, psi: float, alpha: float = ALPHA) -> tuple[np.ndarray, np.ndarray]:
    """Every plausible flip table of n pairs when the arms are equal at discordance psi, as (Tango lower bound,
    probability): flips m ~ Binomial(n, psi), gained | m ~ Binomial(m, 1/2). Tails below 1e-9 are left out."""
    tail = 1e-9
    if psi <= 0:
        m = np.array([0])
    else:
        m = np.arange(int(binom.ppf(tail, n, psi)), int(binom.isf(tail, n, psi)) + 1)
    pm = binom.pmf(m, n, psi) if psi > 0 else np.ones(1)
    gained, lost, prob = [], [], []
    for mi, pi in zip(m, pm):
        g = np.arange(int(binom.ppf(tail, mi, 0.5)), int(binom.isf(tail, mi, 0.5)) + 1) if mi else np.zeros(1, int)
        gained.append(g)
        lost.append(mi - g)
        prob.append(pi * (binom.pmf(g, mi, 0.5) if mi else np.ones(1)))
    gained, lost, prob = np.concatenate(gained), np.concatenate(lost), np.concatenate(prob)
    lower, _ = tango_interval(gained, lost, n, 1 - alpha)
    return lower, prob / prob.sum()


def greedy_power(n: int, psi: float, margin: float, alpha: float = ALPHA) -> float:
    """Probability that n equal-arm pairs at discordance psi give 'non-inferior' at `margin` (Tango's interval);
    the normal form Phi(margin / sqrt(psi / n) - z) beyond MANY_FLIPS expected flips."""
    if n * psi > MANY_FLIPS:
        return float(norm.cdf(margin / math.sqrt(psi / n) - z_quantile(1 - alpha)))
    lower, prob = equal_arm_lower_bounds(n, psi, alpha)
    return float(prob[lower > -margin].sum())


def greedy_mde(n: int, psi: float | None, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """Smallest margin (a proportion) that n pairs at discordance psi establish with probability `power` when the
    arms are equal: the `power` quantile of minus Tango's lower bound over the flip tables. By the interval's
    symmetry it is about the drop that a level-alpha test of B = A detects with that power."""
    if n <= 0 or psi is None:
        return None
    if n * psi > MANY_FLIPS:
        return z_sum(alpha, power) * math.sqrt(psi / n)
    lower, prob = equal_arm_lower_bounds(n, psi, alpha)
    order = np.argsort(-lower)
    cum = np.cumsum(prob[order])
    return float(-lower[order][min(int(np.searchsorted(cum, power)), cum.size - 1)])


def greedy_n_needed(
    margin: float, psi: float | None, alpha: float = ALPHA, power: float = POWER, limit: int = 10_000_000
) -> int | None:
    """Fewest pairs whose power (greedy_power) reaches `power` at `margin` and discordance psi: started at the
    normal approximation z_sum^2 psi / margin^2, widened until it holds, then bisected. None beyond `limit`."""
    floor = n_for_no_flips(margin, alpha)
    if floor is None or psi is None:
        return None
    hi = max(math.ceil(z_sum(alpha, power) ** 2 * psi / margin**2), floor)
    lo = floor - 1
    while greedy_power(hi, psi, margin, alpha) < power:
        lo, hi = hi, math.ceil(hi * 1.25)
        if hi > limit:
            return None
    while hi - lo > max(1, hi // 500):  # to 0.2%: power is a sawtooth in n, finer steps chase its teeth
        mid = (lo + hi) // 2
        if greedy_power(mid, psi, margin, alpha) >= power:
            hi = mid
        else:
            lo = mid
    return hi


# ----------------------------------------------------------------------------- repeated (clustered)


def repeated_se(questions: int, repeats: int, within: float, between: float) -> float:
    return math.sqrt((between + within / repeats) / questions)


def repeated_mde(
    questions: int, repeats: int, within: float, between: float, alpha: float = ALPHA, power: float = POWER
) -> float | None:
    if questions < 2 or repeats < 1:
        return None
    return t_sum(questions - 1, alpha, power) * repeated_se(questions, repeats, within, between)


def repeated_questions_needed(
    margin: float,
    repeats: int,
    within: float,
    between: float,
    alpha: float = ALPHA,
    power: float = POWER,
    limit: int = 10_000_000,
) -> int | None:
    """Fewest questions (at `repeats` per question) whose MDE is at most `margin`; None beyond `limit` (or for a
    margin <= 0)."""
    if margin <= 0:
        return None
    per_question = between + within / repeats
    q = max(2, math.ceil(z_sum(alpha, power) ** 2 * per_question / margin**2))  # the normal answer, a lower bound
    while q <= limit:
        if repeated_mde(q, repeats, within, between, alpha, power) <= margin:
            return q
        q += max(1, q // 100)
    return None


def repeated_repeats_needed(
    margin: float, questions: int, within: float, between: float, alpha: float = ALPHA, power: float = POWER
) -> int | None:
    """Fewest repeats per question (at `questions`) whose MDE is at most `margin`; None when even infinitely many
    repeats would not do, because the between-question variance alone exceeds what the margin allows."""
    if questions < 2 or margin <= 0:
        return None
    room = questions * (margin / t_sum(questions - 1, alpha, power)) ** 2 - between
    if room <= 0:
        return None
    return max(1, math.ceil(within / room)) if within > 0 else 1


def within_from_icc(accuracy: float, icc: float) -> float:
    """Per-response variance of both arms summed when both have mean `accuracy` and intra-question correlation
    `icc`: 2 p (1 - p) (1 - icc) (the share of outcome variance not explained by the question)."""
    return 2 * accuracy * (1 - accuracy) * (1 - icc)


# ----------------------------------------------------------------------------- bench (ratio of medians)


def ratio_mde_pct(
    sd_log_a: float, n_a: int, sd_log_b: float, n_b: int, alpha: float = ALPHA, power: float = POWER
) -> float | None:
    """Smallest change of a median, in percent, that two benches with these spreads detect at `power`."""
    if n_a < 2 or n_b < 2:
        return None
    se = MEDIAN_SE_FACTOR * math.sqrt(sd_log_a**2 / n_a + sd_log_b**2 / n_b)
    return 100 * (math.exp(z_sum(alpha, power) * se) - 1)
