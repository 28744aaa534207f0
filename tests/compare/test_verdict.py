"""The verdict's statistics: Tango's interval against published values and by simulation, the zero-flip cases,
the MDE and the planner against simulations of their own claims, and the CI gate's exit codes.

All simulations are seeded and vectorised (numpy), so the file runs in seconds.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner
from scipy.optimize import minimize_scalar
from scipy.stats import t as t_dist

from evalpipe.commands.compare import command as compare_cmd
from evalpipe.commands.plan import command as plan_cmd
from evalpipe.compare import intervals, power
from evalpipe.compare.bench_compare import change_verdict
from evalpipe.compare.stats import bootstrap_ratio_of_medians, compare_greedy
from tests.compare.test_compare import record, write_run

Z = 1.959963984540054


# ----------------------------------------------------------------------------- Tango's interval: exact values

# Published 95% Tango intervals for p1 - p2 of a paired 2x2 table (a, b, c, d) (difference = (b - c) / n), as
# collected in the tests of the ratesci R package (P. J. Laud, github.com/petelaud/ratesci, tests/testthat):
#  - Fagerland M.W., Lydersen S., Laake P. (2014), Recommended tests and confidence intervals for paired binomial
#    proportions, Statistics in Medicine 33:2850-2875 (Bentur et al. airway data): (-0.517, -0.026), 3 decimals;
#  - Tang M.-L. et al. (2010) worked example: (-0.1670, 0.4327), 4 decimals;
#  - Chang P. et al. (2024), Journal of Applied Statistics 51:139-152: (0.139, 0.321), 3 decimals.
PUBLISHED_TANGO = [
    ((1, 1, 7, 12), (-0.517, -0.026), 3),
    ((8, 3, 1, 2), (-0.1670, 0.4327), 4),
    ((7, 25, 2, 68), (0.139, 0.321), 3),
]


@pytest.mark.parametrize("table,expected,digits", PUBLISHED_TANGO)
def test_tango_interval_matches_published_values(table, expected, digits):
    a, b, c, d = table
    iv = intervals.paired_difference_interval(gained=b, lost=c, n=a + b + c + d)
    assert (round(iv["low"], digits), round(iv["high"], digits)) == expected
    assert iv["method"].startswith("Tango") and iv["confidence"] == 0.95


@pytest.mark.parametrize("n", [1, 4, 60, 100, 381, 1314])
def test_zero_flip_bounds_are_z2_over_n_plus_z2(n):
    """Solving Z(delta) = +-z at gained = lost = 0 gives +-z^2 / (n + z^2) (docs/statistics.md section 1)."""
    lo, hi = intervals.tango_interval(0, 0, n)
    assert float(hi) == pytest.approx(Z**2 / (n + Z**2), rel=1e-9)
    assert float(lo) == pytest.approx(-(Z**2) / (n + Z**2), rel=1e-9)


def test_restricted_mle_and_bounds_solve_the_score_equation():
    """The closed-form restricted MLE maximises the multinomial likelihood under B - A = delta (checked by a
    numerical optimiser), and each bound is where |Z| = z."""
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    for _ in range(20):
        n = int(rng.integers(5, 400))
        gained, lost = (int(x) for x in rng.multinomial(n, [0.1, 0.15, 0.75])[:2])
        delta = float(rng.uniform(-0.3, 0.3))

        def nll(q):
            p_gained, p_lost = q + delta, q
            rest = 1 - p_gained - p_lost
            return -(gained * np.log(p_gained) + lost * np.log(p_lost) + (n - gained - lost) * np.log(rest))

        q_lo, q_hi = max(0.0, -delta) + 1e-12, (1 - delta) / 2 - 1e-12
        q_num = minimize_scalar(nll, bounds=(q_lo, q_hi), method="bounded", options={"xatol": 1e-12}).x
        w = -gained - lost + (2 * n - gained + lost) * delta
        q_closed = (np.sqrt(w * w + 8 * n * lost * delta * (1 - delta)) - w) / (4 * n)
        assert q_closed == pytest.approx(q_num, abs=1e-6)
        lo, hi = intervals.tango_interval(gained, lost, n)
        for bound, target in ((lo, Z), (hi, -Z)):
            if -1 < bound < 1:
                assert float(intervals.tango_statistic(bound, gained, lost, n)) == pytest.approx(target, abs=1e-6)


# ----------------------------------------------------------------------------- coverage by simulation

COVERAGE_DRAWS = 20_000  # per cell; the issue asks for >= 2,000


def coverage_table(seed: int = 27) -> list[tuple[int, float, float, float]]:
    """(n, discordance, true difference, coverage of the 95% interval) for every feasible cell: pairs are drawn
    with P(gained) = (psi + d) / 2, P(lost) = (psi - d) / 2."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in (20, 60, 200, 1314):
        for psi in (0.0, 0.01, 0.05, 0.20):
            for d in (0.0, -0.01, -0.03):
                p_gained, p_lost = (psi + d) / 2, (psi - d) / 2
                if p_gained < -1e-12:
                    continue  # |d| > psi: no such pair of arms
                p_gained = max(p_gained, 0.0)
                draws = rng.multinomial(n, [p_gained, p_lost, 1 - p_gained - p_lost], size=COVERAGE_DRAWS)
                cells, counts = np.unique(draws[:, :2], axis=0, return_counts=True)  # one interval per table
                lo, hi = intervals.tango_interval(cells[:, 0], cells[:, 1], n)
                covered = (lo <= d + 1e-12) & (d - 1e-12 <= hi)
                rows.append((n, psi, d, float(np.sum(counts * covered)) / COVERAGE_DRAWS))
    return rows


def test_tango_interval_covers_at_least_94_percent_in_every_cell():
    rows = coverage_table()
    print("\n   n  discordance  true diff  coverage")
    for n, psi, d, cov in rows:
        print(f"{n:>5}  {100 * psi:>10.0f}%  {100 * d:>+8.0f} pt  {100 * cov:>7.2f}%")
    worst = min(rows, key=lambda r: r[3])
    print(
        f"worst cell: n={worst[0]}, discordance {100 * worst[1]:.0f}%, diff {100 * worst[2]:+.0f} pt: "
        f"{100 * worst[3]:.2f}%"
    )
    assert len(rows) == 4 * (1 + 2 + 3 + 3)  # every feasible (discordance, difference) at each n
    assert worst[3] >= 0.94, worst


def test_repeated_t_interval_covers_with_30_questions_where_the_normal_one_does_not_reach_95():
    """AIME-like: 30 questions x 16 repeats, question difficulties from a Beta; the t interval (29 df) covers the
    true difference 0 at least 94% of the time, and more often than a normal quantile would."""
    from evalpipe.compare.stats import clustered_interval

    rng = np.random.default_rng(30)
    q, k, draws = 30, 16, 4000
    p = rng.beta(0.6, 0.9, size=(draws, q))
    d = (rng.binomial(k, p) - rng.binomial(k, p)) / k
    mean, se = d.mean(axis=1), d.std(axis=1, ddof=1) / np.sqrt(q)
    iv = clustered_interval(0.0, 1.0, q, 1.0)
    half_t = iv["ci_high"]  # a unit SE: the half-width is the quantile
    assert half_t == pytest.approx(t_dist.ppf(0.975, 29))
    covered_t = np.mean(np.abs(mean) <= half_t * se)
    covered_z = np.mean(np.abs(mean) <= Z * se)
    assert covered_t >= 0.94 and covered_t > covered_z


# ----------------------------------------------------------------------------- zero flips and both-all-right


@pytest.mark.parametrize(
    "n,expected",
    [(4, "inconclusive"), (60, "inconclusive"), (380, "inconclusive"), (381, "non-inferior"), (1314, "non-inferior")],
)
def test_zero_flips_is_non_inferior_at_one_point_only_from_381_questions(n, expected):
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    right = rng.random(n) < 0.7
    right[rng.integers(n)] = True  # all-wrong arms are not-evaluable (tested below): 0.3**4 of n=4 draws
    g = compare_greedy(right, right.copy(), margin_pts=1.0, n_resamples=200)
    assert g.verdict == expected
    assert g.bootstrap["ci_low"] == g.bootstrap["ci_high"] == 0.0  # what used to decide, and why it could not
    assert g.n_needed_if_no_flips == 381
    assert g.planning_discordance["rate"] == pytest.approx(1 - 0.05 ** (1 / n))
    assert "upper bound" in g.planning_discordance["basis"]


def test_both_arms_all_right_is_informative_and_all_wrong_is_not():
    right = np.ones(1314, dtype=bool)
    g = compare_greedy(right, right.copy(), margin_pts=1.0, n_resamples=200)
    assert g.informative and g.verdict_note is None and g.verdict == "non-inferior"
    wrong = compare_greedy(~right, ~right, margin_pts=1.0, n_resamples=200)
    assert (
        not wrong.informative and wrong.verdict == "not-evaluable" and "all 1314 questions wrong" in wrong.verdict_note
    )


# ----------------------------------------------------------------------------- MDE and the planner


@pytest.mark.parametrize("n,psi", [(60, 0.0487), (300, 0.05), (1314, 0.02), (1314, 0.2)])
def test_greedy_mde_is_the_margin_reached_with_80_percent_power(n, psi):
    """Simulate equal arms at the MDE's design: the verdict's interval excludes -MDE (a hair above it) in about
    80% of draws and -MDE a tenth smaller in fewer."""
    mde = power.greedy_mde(n, psi)
    rng = np.random.default_rng(n)
    draws = rng.multinomial(n, [psi / 2, psi / 2, 1 - psi], size=20_000)
    lo, _ = intervals.tango_interval(draws[:, 0], draws[:, 1], n)
    reached = np.mean(lo > -(mde + 1e-9))
    assert reached >= 0.79
    assert np.mean(lo > -0.9 * mde) < reached
    assert mde >= Z**2 / (n + Z**2) - 1e-12  # never narrower than the zero-flip interval


@pytest.mark.parametrize("margin_pts,discordance", [(1, "0.01"), (2, "0.1"), (3, "0.2")])
def test_plan_recommendation_has_80_percent_power_in_simulation(margin_pts, discordance):
    res = CliRunner().invoke(plan_cmd, ["--margin", str(margin_pts), "--discordance", discordance, "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    n, psi, margin = plan["greedy"]["questions_needed"], float(discordance), margin_pts / 100
    rng = np.random.default_rng(margin_pts)
    draws = rng.multinomial(n, [psi / 2, psi / 2, 1 - psi], size=8000)
    lo, _ = intervals.tango_interval(draws[:, 0], draws[:, 1], n)
    simulated = float(np.mean(lo > -margin))
    print(
        f"\nplan margin {margin_pts} pt, discordance {psi:.0%}: n = {n}, exact power "
        f"{plan['greedy']['power_at_questions_needed']:.4f}, simulated {simulated:.4f}"
    )
    assert abs(simulated - 0.80) <= 0.03
    assert abs(simulated - plan["greedy"]["power_at_questions_needed"]) <= 0.02
    lanes = {row["lane"]: row for row in plan["lanes"]}
    assert lanes["gsm8k"]["questions"] == 1314 and lanes["arith"]["questions"] == 1200
    assert (lanes["aime26-x16"]["questions"], lanes["aime26-x16"]["repeats"]) == (30, 16)


def test_plan_repeated_recommendation_has_80_percent_power_in_simulation():
    """Questions drawn with accuracy 0.5 and intra-question correlation 0.3 (Beta(0.5 s, 0.5 s), s = 1/0.3 - 1),
    16 responses per arm, equal arms: the clustered t interval excludes -5 pt in about 80% of draws at the planned
    number of questions."""
    res = CliRunner().invoke(
        plan_cmd, ["--margin", "5", "--accuracy", "0.5", "--icc", "0.3", "--repeats", "16", "--json"]
    )
    assert res.exit_code == 0, res.output
    q = json.loads(res.output)["repeated"]["questions_needed"]
    s = 1 / 0.3 - 1
    rng = np.random.default_rng(5)
    p = rng.beta(0.5 * s, 0.5 * s, size=(8000, q))
    d = (rng.binomial(16, p) - rng.binomial(16, p)) / 16
    low = d.mean(axis=1) - t_dist.ppf(0.975, q - 1) * d.std(axis=1, ddof=1) / np.sqrt(q)
    simulated = float(np.mean(low > -0.05))
    print(f"\nplan repeated margin 5 pt, icc 0.3, 16 repeats: {q} questions, simulated power {simulated:.4f}")
    assert abs(simulated - 0.80) <= 0.03


def test_plan_reads_two_pilot_folders_and_refuses_bad_input(tmp_path):
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    right = rng.random(200) < 0.6
    flip = set(rng.choice(200, size=6, replace=False).tolist())
    a = write_run(tmp_path / "A", "off", [record("off", q, 0, right[q]) for q in range(200)])
    b = write_run(tmp_path / "B", "on", [record("on", q, 0, right[q] != (q in flip)) for q in range(200)])
    res = CliRunner().invoke(plan_cmd, ["--margin", "2", "--pilot", str(a), "--pilot", str(b), "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.output)
    assert plan["greedy"]["discordance"] == pytest.approx(6 / 200)
    assert plan["greedy"]["questions_needed"] == power.greedy_n_needed(0.02, 6 / 200)
    text = CliRunner().invoke(plan_cmd, ["--margin", "2", "--pilot", str(a), "--pilot", str(b)])
    assert f"needs {plan['greedy']['questions_needed']} questions" in text.output
    for bad in (["--discordance", "1.5"], ["--margin", "0"], ["--icc", "1"], ["--pilot", str(a)] * 3):
        res = CliRunner().invoke(plan_cmd, bad)
        assert res.exit_code == 2, (bad, res.output)
    not_a_run = a.parent / "not-a-run"
    not_a_run.mkdir()
    res = CliRunner().invoke(plan_cmd, ["--margin", "2", "--pilot", str(not_a_run)])
    assert res.exit_code == 2 and str(not_a_run) in res.output, res.output


# ----------------------------------------------------------------------------- the terminal line and the gate


def identical_pair(tmp_path, n: int):
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    right = rng.random(n) < 0.75
    a = write_run(tmp_path / "A", "off", [record("off", q, 0, right[q]) for q in range(n)])
    b = write_run(tmp_path / "B", "on", [record("on", q, 0, right[q]) for q in range(n)])
    return a, b


def numbers(text: str) -> list[str]:
    return re.findall(r"[-+]?\d+(?:\.\d+)?", text)


def test_every_number_in_the_greedy_lines_is_in_compare_json(tmp_path):
    a, b = identical_pair(tmp_path, 60)
    res = CliRunner().invoke(
        compare_cmd, [str(a), str(b), "--out", str(tmp_path / "o"), "--resamples", "200", "--no-html"]
    )
    assert res.exit_code == 0, res.output
    g = json.loads((tmp_path / "o" / "compare.json").read_text())["greedy"]
    lines = [x for x in res.output.splitlines() if x.startswith(("outputs ", "paired"))]
    assert lines[0].startswith("outputs token-identical in all 60 pairs")  # identity first
    text = " ".join(lines)
    ident, iv, plan, bs = g["output_identity"], g["interval"], g["planning_discordance"], g["bootstrap"]
    allowed = {
        str(x)
        for x in (
            60,
            g["b_only"],
            g["a_only"],
            g["n"],
            g["n_needed_for_margin"],
            g["n_needed_if_no_flips"],
            bs["n_resamples"],
            bs["seed"],
            95,
            80,
        )
    }
    allowed |= {
        f"{g['mcnemar_p']:.4g}",
        f"{g['margin_pts']}",
        f"{g['margin_pts']:g}",
        f"{g['mde_pts']:.2f}",
        f"{100 * plan['rate']:.2f}",
        f"{100 * ident['discordance_upper_bound']:.2f}",
        f"{-100 * ident['discordance_upper_bound']:+.2f}",
        f"{100 * iv['low']:+.2f}",
        f"{100 * iv['high']:+.2f}",
        f"{100 * bs['ci_low']:+.2f}",
        f"{100 * bs['ci_high']:+.2f}",
        "0.05",
        "1998",
    }
    found = numbers(text)
    stray = [x for x in found if x not in allowed and x.lstrip("+-") not in allowed]
    assert not stray, (stray, text)
    assert f"[{100 * iv['low']:+.2f} pt, {100 * iv['high']:+.2f} pt]" in text and "inconclusive" in text
    assert f"smallest detectable drop {g['mde_pts']:.2f} pt" in text
    assert f"-1 pt needs {g['n_needed_for_margin']} questions" in text
    assert f"{g['n_needed_if_no_flips']} if none flips" in text


def test_fail_on_exits_4_on_a_listed_verdict_and_0_otherwise(tmp_path):
    a, b = identical_pair(tmp_path, 60)
    base = [str(a), str(b), "--resamples", "200", "--no-html"]
    res = CliRunner().invoke(compare_cmd, base + ["--out", str(tmp_path / "1"), "--fail-on", "inferior,inconclusive"])
    assert res.exit_code == 4, res.output
    assert "gate: verdict inconclusive" in res.output
    assert (tmp_path / "1" / "compare.json").is_file()  # the comparison is written in full first
    res = CliRunner().invoke(compare_cmd, base + ["--out", str(tmp_path / "2"), "--fail-on", "inferior"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(
        compare_cmd, base + ["--out", str(tmp_path / "3"), "--margin", "10", "--fail-on", "inferior,inconclusive"]
    )
    assert res.exit_code == 0, res.output  # 60 identical questions do support -10 pt
    res = CliRunner().invoke(compare_cmd, base + ["--out", str(tmp_path / "4")])
    assert res.exit_code == 0, res.output  # no flag: a finished comparison exits 0
    res = CliRunner().invoke(compare_cmd, base + ["--out", str(tmp_path / "5"), "--fail-on", "worse"])
    assert res.exit_code == 2 and "unknown verdict(s) worse" in res.output
    assert not (tmp_path / "5").exists()


# ----------------------------------------------------------------------------- bench verdicts


def test_bench_verdict_no_measurable_change_when_samples_overlap_and_mde_in_percent():
    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    a = list(rng.normal(100, 5, 8))
    same = list(rng.normal(100, 5, 8))
    ratio = bootstrap_ratio_of_medians(a, same, n_resamples=2000)
    v = change_verdict(ratio, a, same)
    assert v["samples_overlap"] is True
    if ratio["ci_low"] <= 1 <= ratio["ci_high"]:
        assert v["verdict"] == "no measurable change"
    la, lb = np.log(a), np.log(same)
    se = np.sqrt(np.pi / 2) * np.sqrt(np.var(la, ddof=1) / 8 + np.var(lb, ddof=1) / 8)
    assert v["mde_pct"] == pytest.approx(100 * (np.exp((Z + 0.8416212335729143) * se) - 1))
    faster = [x * 1.5 for x in a]
    v = change_verdict(bootstrap_ratio_of_medians(a, faster, n_resamples=2000), a, faster)
    assert v["verdict"] == "higher" and v["samples_overlap"] is False
    assert change_verdict(bootstrap_ratio_of_medians([], [], n_resamples=100), [], [])["verdict"] == "not-evaluable"


def test_plan_lane_designs_are_the_lanes_as_configured():
    """plan's table (gsm8k 1,314; arith 1,200; aime26-x16 30 x 16) is what loading each lane gives."""
    import os
    from pathlib import Path

    from evalpipe.compare.planning import LANE_DESIGNS
    from evalpipe.lanes import get_lane

    data_dir = Path(os.environ.get("EVALPIPE_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
    for name, questions, repeats, kind in LANE_DESIGNS:
        lane = get_lane(name)
        assert len(lane.load(data_dir, False).items) == questions and lane.repeats == repeats, name
        assert (kind == "repeated") == (repeats > 1)


def test_plan_from_one_pilot_folder(tmp_path):
    """One repeated pilot gives accuracy and intra-question correlation (1 - mean s2_i / (p (1 - p))); one greedy
    pilot gives the discordance of independent arms at its accuracy, 2 p (1 - p)."""
    from tests.compare.test_compare import repeated_records

    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    outcomes = {f"q{i}": [int(x) for x in rng.random(8) < p] for i, p in enumerate(rng.beta(1, 1, 20))}
    recs = repeated_records("A", outcomes)
    for r in recs:
        r["lane"] = "gsm8k"  # the snapshot helper describes gsm8k; only agreement matters
    folder = write_run(tmp_path / "rep", "A", recs)
    res = CliRunner().invoke(plan_cmd, ["--margin", "5", "--pilot", str(folder), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)["repeated"]
    p = np.mean([x for v in outcomes.values() for x in v])
    icc = 1 - np.mean([np.var(v, ddof=1) for v in outcomes.values()]) / (p * (1 - p))
    assert rep["accuracy"] == pytest.approx(p) and rep["icc"] == pytest.approx(min(max(icc, 0), 1))
    assert rep["within_variance"] == pytest.approx(2 * p * (1 - p) * (1 - rep["icc"]))
    right = rng.random(50) < 0.8
    greedy = write_run(tmp_path / "g", "A", [record("A", q, 0, right[q]) for q in range(50)])
    res = CliRunner().invoke(plan_cmd, ["--margin", "5", "--pilot", str(greedy), "--json"])
    acc = right.mean()
    assert json.loads(res.output)["greedy"]["discordance"] == pytest.approx(2 * acc * (1 - acc))


def test_plan_from_two_repeated_pilots_uses_compares_variances(tmp_path):
    from evalpipe.compare.stats import compare_repeated
    from tests.compare.test_compare import repeated_records

    rng = np.random.default_rng(int(np.random.default_rng().integers(1 << 30)))
    probs = rng.beta(1, 1, 12)
    runs = {}
    for arm in ("A", "B"):
        runs[arm] = {f"q{i}": [int(x) for x in rng.random(6) < p] for i, p in enumerate(probs)}
        recs = repeated_records(arm, runs[arm])
        for r in recs:
            r["lane"] = "gsm8k"
        write_run(tmp_path / arm, arm, recs)
    res = CliRunner().invoke(
        plan_cmd, ["--margin", "5", "--pilot", str(tmp_path / "A"), "--pilot", str(tmp_path / "B"), "--json"]
    )
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)["repeated"]
    direct = compare_repeated(
        {q: np.array(v, float) for q, v in runs["A"].items()},
        {q: np.array(v, float) for q, v in runs["B"].items()},
        n_permutations=10,
    )["power"]
    assert rep["within_variance"] == pytest.approx(direct["within_variance"])
    assert rep["between_variance"] == pytest.approx(direct["between_variance"])
    assert rep["questions_needed"] == power.repeated_questions_needed(
        0.05, 16, direct["within_variance"], direct["between_variance"]
    )
