"""`evalpipe plan`'s arithmetic: the questions (and repeats) a non-inferiority margin needs, and the smallest
detectable drop of each lane as configured, from stated assumptions or from one or two pilot run folders.

Every figure comes from power.py, the rules `evalpipe compare` reports beside its verdicts, so a plan and a later
comparison agree on what a design can show.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from evalpipe.compare import power, stats
from evalpipe.compare.analysis import analyse
from evalpipe.compare.intervals import upper_bound_rate
from evalpipe.compare.runfolder import LoadedRun, load_run
from evalpipe.harness.metrics import is_correct

# (lane, questions, repeats per question, kind) as the lanes are configured (evalpipe lanes)
LANE_DESIGNS = (("gsm8k", 1314, 1, "greedy"), ("arith", 1200, 1, "greedy"), ("aime26-x16", 30, 16, "repeated"))


@dataclass
class Assumptions:
    """What a plan assumes, each with where it came from."""

    discordance: float | None = None  # greedy lanes: share of questions whose correctness differs between arms
    discordance_source: str = "not given"
    accuracy: float = 0.5  # repeated lanes: mean per-response accuracy, in (0, 1)
    icc: float = 0.0  # repeated lanes: intra-question correlation of correctness
    between: float = 0.0  # repeated lanes: variance of the true per-question differences B - A
    repeated_source: str = "assumed"
    measured_within: float | None = None  # two repeated pilots: compare's own estimate, used as it is

    @property
    def within(self) -> float:
        if self.measured_within is not None:
            return self.measured_within
        return power.within_from_icc(self.accuracy, self.icc)


def outcomes_by_question(run: LoadedRun) -> dict:
    out: dict = {}
    for (_, qid, _), rec in run.by_key.items():
        out.setdefault(qid, []).append(float(is_correct(rec)))
    return {q: np.array(v) for q, v in out.items()}


def from_one_pilot(run: LoadedRun, base: Assumptions) -> Assumptions:
    """One arm: its accuracy, and for a repeated run its intra-question correlation. A greedy run cannot show how
    often two arms disagree, so it plans with 2 p (1 - p), the discordance of two independent arms at accuracy p."""
    outcomes = outcomes_by_question(run)
    if not outcomes:
        return base
    flat = np.concatenate(list(outcomes.values()))
    p = float(np.mean(flat))
    if p in (0.0, 1.0):  # never plan with zero variance: the exact 95% bound on the outcome never seen
        u = upper_bound_rate(0, flat.size)
        p = u if p == 0.0 else 1 - u
    if run.repeated:
        s2 = [float(np.var(o, ddof=1)) for o in outcomes.values() if o.size >= 2]
        icc = 1 - float(np.mean(s2)) / (p * (1 - p)) if s2 and 0 < p < 1 else base.icc
        return Assumptions(
            base.discordance,
            base.discordance_source,
            p,
            min(max(icc, 0.0), 1.0),
            base.between,
            f"pilot {run.path}: accuracy and intra-question correlation",
        )
    return Assumptions(
        2 * p * (1 - p),
        f"pilot {run.path}: 2 p (1 - p) at accuracy {p:.4f} (arms as if independent)",
        base.accuracy,
        base.icc,
        base.between,
        base.repeated_source,
    )


def from_two_pilots(a: LoadedRun, b: LoadedRun, base: Assumptions) -> Assumptions:
    """Two arms of one lane: the discordance they showed (its exact upper bound if none), or for repeated runs the
    within- and between-question variances `evalpipe compare` estimates."""
    result = analyse(a, b, margin_pts=1.0, seed=stats.DEFAULT_SEED, n_resamples=100, intended=[], forced=[])
    if result.get("greedy"):
        plan = result["greedy"]["planning_discordance"]
        return Assumptions(
            plan["rate"],
            f"pilots {a.path} and {b.path}: {plan['basis']}",
            base.accuracy,
            base.icc,
            base.between,
            base.repeated_source,
        )
    r = result["repeated_stats"]
    pw = r.get("power") or {}
    p = float(np.mean([r["mean_rate_a"], r["mean_rate_b"]]))
    if pw.get("within_variance") is None:
        return base
    icc = 1 - pw["within_variance"] / (2 * p * (1 - p)) if 0 < p < 1 else base.icc
    return Assumptions(
        base.discordance,
        base.discordance_source,
        p,
        min(max(icc, 0.0), 1.0),
        pw["between_variance"],
        f"pilots {a.path} and {b.path}: within- and between-question variance ({pw['variance_basis']})",
        measured_within=pw["within_variance"],
    )


def assumptions_from(pilots: list[str], base: Assumptions) -> Assumptions:
    runs = [load_run(p) for p in pilots]
    if len(runs) == 1:
        return from_one_pilot(runs[0], base)
    if len(runs) == 2:
        return from_two_pilots(runs[0], runs[1], base)
    return base


def plan(margin_pts: float, assume: Assumptions, repeats: int | None = None) -> dict:
    """The questions the margin needs (greedy; repeated at `repeats` per question) and every configured lane's MDE."""
    margin = margin_pts / 100
    psi = assume.discordance
    n_greedy = power.greedy_n_needed(margin, psi) if psi is not None else None
    lanes = []
    for lane, questions, lane_repeats, kind in LANE_DESIGNS:
        if kind == "greedy":
            mde = power.greedy_mde(questions, psi) if psi is not None else None
            need_q, need_k = n_greedy, None
        else:
            mde = power.repeated_mde(questions, lane_repeats, assume.within, assume.between)
            need_q = power.repeated_questions_needed(margin, lane_repeats, assume.within, assume.between)
            need_k = power.repeated_repeats_needed(margin, questions, assume.within, assume.between)
        lanes.append(
            {
                "lane": lane,
                "kind": kind,
                "questions": questions,
                "repeats": lane_repeats,
                "mde_pts": None if mde is None else 100 * mde,
                "supports_margin": None if mde is None else mde <= margin,
                "questions_needed": need_q,
                "repeats_needed": need_k,
            }
        )
    k = repeats or next(r for _, _, r, kind in LANE_DESIGNS if kind == "repeated")
    return {
        "margin_pts": margin_pts,
        "alpha": power.ALPHA,
        "power": power.POWER,
        "greedy": {
            "discordance": psi,
            "source": assume.discordance_source,
            "questions_needed": n_greedy,
            "power_at_questions_needed": None if n_greedy is None else power.greedy_power(n_greedy, psi, margin),
            "questions_needed_if_no_flips": power.n_for_no_flips(margin),
        },
        "repeated": {
            "repeats": k,
            "accuracy": assume.accuracy,
            "icc": assume.icc,
            "within_variance": assume.within,
            "between_variance": assume.between,
            "source": assume.repeated_source,
            "questions_needed": power.repeated_questions_needed(margin, k, assume.within, assume.between),
        },
        "lanes": lanes,
    }
