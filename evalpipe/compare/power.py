"""The smallest detectable difference (MDE) of a comparison, and the sample size a margin needs.

One normal-approximation rule, read both ways: a design whose standard error of B - A is `se` detects a drop of
(z_{1-alpha/2} + z_{power}) * se with probability `power` by a two-sided level-alpha test, and, when the arms are
truly equal, its (1 - alpha) interval excludes -margin with that probability once the margin reaches the same
value. So MDE(n) = margin exactly when n = n_needed(margin).

- Greedy lanes (paired 0/1 outcomes): se = sqrt(psi / n) with psi the discordance rate, the conservative form of
  Connor (1987, Biometrics 43:207-211), which drops the -d^2 term. No interval for B - A is narrower than Tango's
  at zero flips, +-z^2 / (n + z^2), so that is a floor: a margin M needs n > z^2 (1 - M) / M even with no flips
  (381 questions for 1 point). With no discordant pair observed, plan with the exact one-sided 95% upper bound
  on psi (`intervals.upper_bound_rate`), never with 0.
- Repeated lanes (Q questions x k responses, clustered by question): se = sqrt((between + within / k) / Q), where
  `within` is the per-response outcome variance of both arms summed and `between` the variance of the true
  per-question differences; t quantiles with Q - 1 degrees of freedom.
- Bench throughput: the ratio of medians on the log scale, se(log median) ~ 1.2533 sd(log x) / sqrt(n) (the
  median's asymptotic efficiency against the mean under normality, sqrt(pi / 2)).
"""

from __future__ import annotations

import math

from scipy.stats import norm, t

from evalpipe.compare.intervals import upper_bound_rate, z_quantile

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
    return {"rate": upper_bound_rate(0, n, confidence),
            "basis": f"exact one-sided {confidence:.0%} upper bound (no discordant pair observed)"}


def zero_flip_floor(n: int, alpha: float = ALPHA) -> float:
    """Half-width of Tango's interval at zero flips, z^2 / (n + z^2): no paired interval is narrower."""
    z2 = z_quantile(1 - alpha) ** 2
    return z2 / (n + z2)


def greedy_mde(n: int, psi: float | None, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """Smallest drop (a proportion) that n pairs with discordance `psi` detect at `power`."""
    if n <= 0 or psi is None:
        return None
    return max(z_sum(alpha, power) * math.sqrt(psi / n), zero_flip_floor(n, alpha))


def n_for_no_flips(margin: float, alpha: float = ALPHA) -> int | None:
    """Fewest pairs whose zero-flip interval excludes -margin (margin a proportion)."""
    if not 0 < margin < 1:
        return None
    z2 = z_quantile(1 - alpha) ** 2
    return math.floor(z2 * (1 - margin) / margin) + 1


def greedy_n_needed(margin: float, psi: float | None, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Pairs needed for a non-inferior verdict at `margin` with probability `power` when the arms are equal."""
    floor = n_for_no_flips(margin, alpha)
    if floor is None or psi is None:
        return None
    return max(math.ceil(z_sum(alpha, power) ** 2 * psi / margin ** 2), floor)


# ----------------------------------------------------------------------------- repeated (clustered)

def repeated_se(questions: int, repeats: int, within: float, between: float) -> float:
    return math.sqrt((between + within / repeats) / questions)


def repeated_mde(questions: int, repeats: int, within: float, between: float,
                 alpha: float = ALPHA, power: float = POWER) -> float | None:
    if questions < 2 or repeats < 1:
        return None
    return t_sum(questions - 1, alpha, power) * repeated_se(questions, repeats, within, between)


def repeated_questions_needed(margin: float, repeats: int, within: float, between: float,
                              alpha: float = ALPHA, power: float = POWER, limit: int = 10_000_000) -> int | None:
    """Fewest questions (at `repeats` per question) whose MDE is at most `margin`; None beyond `limit`."""
    per_question = between + within / repeats
    q = max(2, math.ceil(z_sum(alpha, power) ** 2 * per_question / margin ** 2))  # the normal answer, a lower bound
    while q <= limit:
        if repeated_mde(q, repeats, within, between, alpha, power) <= margin:
            return q
        q += max(1, q // 100)
    return None


def repeated_repeats_needed(margin: float, questions: int, within: float, between: float,
                            alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Fewest repeats per question (at `questions`) whose MDE is at most `margin`; None when even infinitely many
    repeats would not do, because the between-question variance alone exceeds what the margin allows."""
    if questions < 2:
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

def ratio_mde_pct(sd_log_a: float, n_a: int, sd_log_b: float, n_b: int,
                  alpha: float = ALPHA, power: float = POWER) -> float | None:
    """Smallest change of a median, in percent, that two benches with these spreads detect at `power`."""
    if n_a < 2 or n_b < 2:
        return None
    se = MEDIAN_SE_FACTOR * math.sqrt(sd_log_a ** 2 / n_a + sd_log_b ** 2 / n_b)
    return 100 * (math.exp(z_sum(alpha, power) * se) - 1)
