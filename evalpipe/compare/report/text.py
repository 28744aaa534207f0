"""The words of a comparison, shared by every view: number formats and the headline sentences.

Sentences carry rich markup (`[bold]...[/]`); the terminal prints it, the HTML page turns it into tags.
"""

from __future__ import annotations

import json
from typing import Any

from rich.markup import escape


def pct(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{100 * x:.{digits}f}%"


def pts(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{100 * x:+.{digits}f} pt"


def spts(x: float | None, digits: int = 2) -> str:
    """Unsigned points, for standard errors."""
    return "n/a" if x is None else f"{100 * x:.{digits}f} pt"


def num(x: Any, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"
    return str(x)


def label(result: dict, arm: str) -> str:
    a = result["arms"][arm]
    return f"{arm.upper()}: {a.get('arm') or a.get('path')}"


def headline_lines(result: dict, details: bool = True) -> list[str]:
    """The few sentences that answer "did anything move". Without `details` the manifest differences are only
    counted (report.html lists them in their own table)."""
    lines = []
    if result.get("forced"):
        lines.append("[bold red]FORCED[/]: compared despite: " + escape("; ".join(result["forced_over"])))
    for arm in ("a", "b"):
        sp = (result.get("spec") or {}).get(arm) or {}
        if sp.get("lossy"):
            lines.append(
                f"[bold yellow]LOSSY acceptance[/] in {escape(label(result, arm))}: "
                f"{escape(lossy_detail(sp))}; its accuracy measures that rule"
            )
    g = result.get("greedy")
    if g:
        lines.extend(greedy_lines(g))
    r = result.get("repeated_stats")
    if r:
        ident = r.get("output_identity") or {}
        if ident.get("all_identical"):
            lines.append(identity_sentence(ident) + " (same seed per question and repeat in both arms)")
        lines.append(repeated_line(r))
    ag = result.get("agreement") or {}
    if "n_pairs" in ag:
        bases = ", ".join(f"{BASIS_LABELS.get(k, k)} {v}" for k, v in ag["basis_counts"].items()) or "n/a"
        lines.append(
            f"output agreement: {ag['n_identical']}/{ag['n_pairs']} identical ({pct(ag['share_identical'])}) by "
            f"{bases}; first divergence median "
            f"{num(ag['first_divergence_median'], 1)}; logprob gap median {num(ag['logprob_gap_median'])}"
        )
        if (result.get("deterministic") or {}).get("note"):
            lines.append(escape(result["deterministic"]["note"]))
        if ag.get("n_identical_tokens_but_text_differs"):
            lines.append(
                f"[bold red]warning[/]: {ag['n_identical_tokens_but_text_differs']} pair(s) have identical "
                "token ids but different text (server detokenization or record fault)"
            )
    overlap = speed_overlap_line(result)
    if overlap:
        lines.append(overlap)
    md = result.get("manifest_diff") or {}
    ignored = len(md.get("volatile_keys_ignored") or [])
    folded = f"; {ignored} volatile key(s) ignored (listed in compare.json)" if ignored else ""
    if md.get("intended_implied") and not md.get("n_unintended"):
        lines.append(escape(f"manifest: {md['intended_implied']}{folded}"))
    elif md.get("differences"):
        if md.get("intended_implied"):
            lines.append(escape(f"manifest: {md['intended_implied']}"))
        unintended = f"[bold]{md['n_unintended']} not marked intended[/]" if md["n_unintended"] else "none unmarked"
        lines.append(
            f"manifest: {len(md['differences'])} difference(s), {md['n_intended']} marked intended, "
            f"{unintended}" + escape(folded) + (":" if details else " (see Manifest differences)")
        )
        if details:
            for d in md["differences"]:
                tag = "intended" if d["intended"] else "UNINTENDED?"
                lines.append(escape(f"  [{d['category']}] {d['key']}: {_short(d['a'])} -> {_short(d['b'])}  ({tag})"))
    else:
        lines.append(escape(f"manifest: no differences outside volatile keys{folded}"))
    return lines


def greedy_lines(g: dict) -> list[str]:
    """Output identity first (when every pair is identical), then the verdict with its interval, MDE and the
    questions the margin needs; the bootstrap last, as a secondary figure."""
    lines = []
    ident = g.get("output_identity") or {}
    if ident.get("all_identical"):
        lines.append(identity_sentence(ident))
    iv, bs = g["interval"], g["bootstrap"]
    lines.append(
        f"paired: B right/A wrong = {g['b_only']}, A right/B wrong = {g['a_only']} of {g['n']}; "
        f"exact McNemar p = {g['mcnemar_p']:.4g}; {int(100 * iv['confidence'])}% CI of B - A by {iv['method']} "
        f"[{pts(iv['low'])}, {pts(iv['high'])}]; "
        f"non-inferiority at -{g['margin_pts']} pt: [bold]{g['verdict']}[/]"
        + (f"; [bold red]no information[/]: {escape(g['verdict_note'])}" if g.get("verdict_note") else "")
    )
    lines.append(
        f"paired power: {mde_sentence(g)}; paired bootstrap {int(100 * bs['confidence'])}% CI "
        f"[{pts(bs['ci_low'])}, {pts(bs['ci_high'])}] ({bs['n_resamples']} resamples, seed {bs['seed']}; "
        "secondary: it collapses to a point when nothing flips)"
    )
    return lines


def identity_sentence(ident: dict) -> str:
    """Every pair identical, and what that bounds."""
    return (
        f"outputs {ident['basis']}-identical in all {ident['n_pairs']} pairs: the rate of differing outputs is at "
        f"most {pct(ident['discordance_upper_bound'])} (exact one-sided {int(100 * ident['confidence'])}% bound), "
        f"so B - A is at least {pts(-ident['discordance_upper_bound'])}"
    )


def mde_sentence(g: dict) -> str:
    """'smallest detectable drop 7.98 pt (...); -1 pt needs 3823 questions (...)' for a greedy comparison."""
    plan = g["planning_discordance"]
    if g.get("mde_pts") is None:
        return "smallest detectable drop n/a (no pairs)"
    needed = g.get("n_needed_for_margin")
    needed = "n/a" if needed is None else needed
    return (
        f"smallest detectable drop {g['mde_pts']:.2f} pt (80% power, alpha 0.05, {g['n']} questions, "
        f"discordance {pct(plan['rate'])}: {plan['basis']}); -{g['margin_pts']:g} pt needs "
        f"{needed} questions at that discordance, {g['n_needed_if_no_flips']} if none flips"
    )


def verdict_summary(g: dict) -> str:
    """One clause for a one-line summary (evalpipe ab): identity, interval, verdict, and when the margin is out of
    reach, how many questions it would take."""
    iv, plan, ident = g["interval"], g["planning_discordance"], g.get("output_identity") or {}
    parts = []
    if ident.get("all_identical"):
        parts.append(
            f"outputs {ident['basis']}-identical in all {ident['n_pairs']} pairs (differing-output rate "
            f"<= {pct(ident['discordance_upper_bound'])}, exact one-sided {int(100 * ident['confidence'])}%)"
        )
    margin = f"-{g['margin_pts']:g} pt"
    parts.append(
        f"Tango {int(100 * iv['confidence'])}% CI of B - A [{pts(iv['low'])}, {pts(iv['high'])}]: "
        f"{g['verdict']} at {margin}"
    )
    if g.get("verdict_note"):
        return "; ".join(parts + [f"no information: {g['verdict_note']}"])
    if g.get("mde_pts") is None:
        return "; ".join(parts)
    mde = f"smallest detectable drop {g['mde_pts']:.2f} pt"
    needed = g.get("n_needed_for_margin")
    if g["verdict"] == "non-inferior" or needed is None or needed <= g["n"]:
        parts[-1] += f" ({mde})"
    elif plan["basis"] == "observed":
        parts.append(
            f"{g['n']} questions cannot support {margin} ({mde}): that needs {needed} questions at the "
            f"observed {pct(plan['rate'])} discordance"
        )
    else:
        parts.append(
            f"{g['n']} questions cannot support {margin} ({mde}): that needs {g['n_needed_if_no_flips']} "
            f"questions if none flips, {needed} at the {pct(plan['rate'])} discordance bound"
        )
    return "; ".join(parts)


def repeated_line(r: dict) -> str:
    pt, iv, pw = r["permutation_test"], r["interval"], r.get("power") or {}
    mde = "n/a" if pw.get("mde_pts") is None else f"{pw['mde_pts']:.2f} pt"
    need_q = pw.get("questions_needed_for_margin")
    need_k = pw.get("repeats_needed_for_margin")
    return (
        f"repeated: {r['n_questions']} questions, mean rate A {pct(r['mean_rate_a'])} B {pct(r['mean_rate_b'])}, "
        f"diff {pts(r['diff'])}; SE fixed-question {spts(r['se_fixed_question'])}, clustered "
        f"{spts(r['se_clustered'])}; within-question permutation p = {num(pt['p_value'], 4)}; "
        f"{int(100 * iv['confidence'])}% CI of B - A ({iv['method']}) [{pts(iv['ci_low'])}, {pts(iv['ci_high'])}]; "
        f"non-inferiority at -{iv['margin_pts']} pt: [bold]{iv['verdict']}[/]; smallest detectable drop {mde} "
        f"(80% power, alpha 0.05, {pw.get('repeats_per_question', 'n/a')} repeats per question); "
        f"-{iv['margin_pts']:g} pt needs {need_q if need_q is not None else 'n/a'} questions at these repeats, or "
        + (
            f"{need_k} repeats per question at these questions"
            if need_k is not None
            else "more questions (no number of repeats suffices at these questions)"
        )
        + (f"; [bold red]no information[/]: {escape(r['note'])}" if r.get("note") else "")
    )


def run_level_cell(metrics: dict | None) -> str:
    """Mean accept length with the counts it comes from (drafts, accepted tokens, per-position acceptance)."""
    if not isinstance(metrics, dict):
        return "-"
    if metrics.get("error"):
        return f"unavailable: {metrics['error']}"
    parts = [num(metrics.get("mean_accept_length"))]
    if "drafts" in metrics:
        per_pos = metrics.get("acceptance_per_position") or []
        parts.append(
            f"({metrics['accepted_tokens']} accepted of {metrics['draft_tokens']} draft tokens in "
            f"{metrics['drafts']} drafts; per position " + ", ".join(f"{x:.2f}" for x in per_pos) + ")"
        )
    elif "verify_calls" in metrics:
        parts.append(f"({metrics['generation_tokens']} tokens / {metrics['verify_calls']} verify calls)")
    return " ".join(parts)


def speed_overlap_line(result: dict) -> str | None:
    """A run comparison's tokens/s are lane responses of varying length: when the arms' samples overlap, say that
    attributing a gain needs a bench."""
    sd = result.get("speed") or {}
    va, vb = (sd.get("a") or {}).get("tokens_per_s") or [], (sd.get("b") or {}).get("tokens_per_s") or []
    if not (va and vb) or min(va) > max(vb) or min(vb) > max(va):
        return None
    return (
        "speed: the tokens/s samples of A and B overlap; attributing a gain needs a fixed-input, warmed, repeated "
        "comparison (evalpipe bench on each arm, then evalpipe compare on the two bench folders)"
    )


def acceptance(sp: dict) -> str:
    """One arm's acceptance rule for the spec section: 'exact', 'off', the LOSSY rule and how many it decided, or
    'not recorded by the source' for an imported run whose harness kept no speculation facts."""
    rules = sp.get("accept_rules") or []
    if sp.get("not_recorded"):
        return "not recorded by the source"
    if not sp.get("lossy"):
        return ", ".join(rules) if rules else ("off" if not sp.get("n_records_with_spec") else "not reported")
    return "LOSSY " + lossy_detail(sp)


def lossy_detail(sp: dict) -> str:
    """'topk (k=3): 3/3 responses report a lossy decision' for an arm whose acceptance was lossy."""
    server = sp.get("server_lossy_acceptance")
    rule = server.get("rule") if isinstance(server, dict) else "/".join(sp.get("accept_rules") or [])
    params = ", ".join(f"{k}={v}" for k, v in (server or {}).items() if k not in ("rule", "lossy", "applies_to"))
    return (
        f"{rule}{f' ({params})' if params else ''}: "
        f"{sp.get('n_records_lossy', 0)}/{sp.get('n_records_with_spec', 0)} responses report a lossy decision"
    )


def _short(v: Any, n: int = 80) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


BENCH_COLUMNS = ("metric", "median A", "median B", "B / A", "95% CI", "verdict", "MDE", "n A", "n B")
THROUGHPUT = "decode_tokens_per_s"


def bench_rows(result: dict) -> list[list]:
    return [
        [
            name,
            num(m.get("median_a")),
            num(m.get("median_b")),
            num(m.get("ratio")),
            f"[{num(m.get('ci_low'))}, {num(m.get('ci_high'))}]",
            m.get("verdict", "n/a"),
            "n/a" if m.get("mde_pct") is None else f"{m['mde_pct']:.1f}%",
            m.get("n_a"),
            m.get("n_b"),
        ]
        for name, m in result["metrics"].items()
    ]


def bench_headline(result: dict) -> list[str]:
    """The throughput verdict with its MDE, and the overlap warning when the two arms' samples intersect."""
    m = result["metrics"].get(THROUGHPUT)
    if not m:
        return []
    mde = "n/a (fewer than 2 values in an arm)" if m.get("mde_pct") is None else f"{m['mde_pct']:.1f}%"
    lines = [
        f"throughput ({THROUGHPUT}): B / A = {num(m.get('ratio'))}, {int(100 * m.get('confidence', 0.95))}% CI "
        f"[{num(m.get('ci_low'))}, {num(m.get('ci_high'))}]: [bold]{m.get('verdict')}[/]; smallest detectable "
        f"change {mde} (80% power, alpha 0.05)"
    ]
    if m.get("samples_overlap"):
        lines.append(
            "the throughput samples of A and B overlap: attributing a gain needs a fixed-input, warmed, "
            "repeated comparison (same --seed inputs, warm-up rounds dropped, --rounds 5 or more per arm, "
            "arms interleaved)"
        )
    return lines


AGREEMENT_LABELS = {
    "n_pairs": "paired responses",
    "n_identical": "identical outputs",
    "share_identical": "share identical",
    "basis_counts": "compared on (pairs per basis)",
    "first_divergence_median": "first differing position, median",
    "first_divergence_min": "first differing position, min",
    "first_divergence_max": "first differing position, max",
    "logprob_gap_median": "logprob gap at the first difference, median",
    "n_with_logprob_gap": "pairs with a logprob gap",
    "n_identical_tokens_but_text_differs": "identical token ids but different text",
}
BASIS_LABELS = {"token_ids": "token ids", "logprob_tokens": "logprob tokens", "text": "text"}


def agreement_value(key: str, value: Any) -> Any:
    if key == "share_identical":
        return pct(value)
    if key == "basis_counts" and isinstance(value, dict):
        return ", ".join(f"{BASIS_LABELS.get(k, k)}: {v}" for k, v in value.items()) or None
    return value
