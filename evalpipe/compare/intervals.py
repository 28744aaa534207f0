"""Intervals for a paired difference of two proportions that stay valid at zero and few discordant pairs.

With n pairs, `gained` = #(A wrong, B right) and `lost` = #(A right, B wrong), the difference B - A is
(gained - lost) / n. A percentile bootstrap or a Wald interval collapses to [0, 0] when nothing flipped, at any n;
Tango's score interval does not: at gained = lost = 0 its bounds are +-z^2 / (n + z^2).

Tango T. (1998), Equivalence test and confidence interval for the difference in proportions for the paired-sample
design, Statistics in Medicine 17:891-908: the interval is every delta whose score statistic
    Z(delta) = (gained - lost - n delta) / sqrt(n (2 q(delta) + delta (1 - delta)))
lies within +-z, where q(delta) is the restricted maximum-likelihood estimate of P(lost) given the difference delta:
    q = (sqrt(W^2 + 8 n lost delta (1 - delta)) - W) / (4 n),   W = -gained - lost + (2 n - gained + lost) delta.
The bounds are found by bisection, vectorised over many tables at once (the coverage simulation needs that).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import beta, norm

BISECTION_STEPS = 60  # halves an interval of width <= 2 down to ~2e-18: beyond float precision


def z_quantile(confidence: float) -> float:
    return float(norm.ppf(0.5 + confidence / 2))


def tango_statistic(delta, gained, lost, n):
    """Tango's score statistic Z(delta) for hypothesised differences `delta` (arrays broadcast)."""
    delta, gained, lost, n = (np.asarray(x, dtype=np.float64) for x in (delta, gained, lost, n))
    w = -gained - lost + (2 * n - gained + lost) * delta
    q = (np.sqrt(np.maximum(w * w + 8 * n * lost * delta * (1 - delta), 0.0)) - w) / (4 * n)
    var = n * (2 * q + delta * (1 - delta))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (gained - lost - n * delta) / np.sqrt(var)


def tango_interval(gained, lost, n, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Tango's score interval for (gained - lost) / n, elementwise over arrays of tables (all n > 0).

    Z(delta) falls from +inf at -1 through 0 at the estimate to -inf at +1, so each bound is the one crossing of
    +-z on its side of the estimate; an estimate at -1 (or +1) is its own lower (upper) bound.
    """
    gained, lost, n = np.broadcast_arrays(*(np.asarray(x, dtype=np.float64) for x in (gained, lost, n)))
    z = z_quantile(confidence)
    est = (gained - lost) / n
    # upper: the largest delta >= est with Z(delta) >= -z
    lo, hi = est.copy(), np.ones_like(est)
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        keep = tango_statistic(mid, gained, lost, n) >= -z
        lo, hi = np.where(keep, mid, lo), np.where(keep, hi, mid)
    upper = lo
    # lower: the smallest delta <= est with Z(delta) <= z
    lo, hi = -np.ones_like(est), est.copy()
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        keep = tango_statistic(mid, gained, lost, n) <= z
        lo, hi = np.where(keep, lo, mid), np.where(keep, mid, hi)
    return hi, upper


def paired_difference_interval(gained: int, lost: int, n: int, confidence: float = 0.95) -> dict:
    """The verdict's interval for B - A: {low, high, method, confidence} (low and high None when n = 0)."""
    low = high = None
    if n > 0:
        lo, hi = tango_interval(gained, lost, n, confidence)
        low, high = float(lo), float(hi)
    return {"low": low, "high": high, "method": "Tango score interval (Tango 1998)", "confidence": confidence}


def upper_bound_rate(k: int, n: int, confidence: float = 0.95) -> float | None:
    """Exact (Clopper-Pearson) one-sided upper bound on a binomial rate from k events in n trials.

    At k = 0 it is 1 - (1 - confidence)^(1/n): with no flip in n pairs, a flip rate above it would have shown one
    with probability at least `confidence`.
    """
    if n <= 0:
        return None
    if k >= n:
        return 1.0
    return float(beta.ppf(confidence, k + 1, n - k))
