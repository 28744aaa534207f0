"""Views of a comparison: compare.json, a rich terminal table, and a self-contained report.html.

The HTML embeds its PNG plots as base64 data URIs (matplotlib Agg), so it opens offline from any folder.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markup import escape  # noqa: E402
from rich.table import Table  # noqa: E402

from evalpipe.console import make_console  # noqa: E402

COLORS = {"a": "#4c72b0", "b": "#dd8452"}


def write_json(result: dict, out_dir: Path) -> Path:
    path = out_dir / "compare.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- formatting helpers

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


# ----------------------------------------------------------------------------- terminal

def print_terminal(result: dict, console: Console | None = None) -> None:
    console = console or make_console()
    if result["kind"] == "bench":
        _print_bench(result, console)
        return
    la, lb = label(result, "a"), label(result, "b")
    t = Table(title=f"evalpipe compare — lane {result.get('lane')}", show_lines=False)
    t.add_column("")
    t.add_column(la)
    t.add_column(lb)
    t.add_column("B - A")
    acc, arms = result["accuracy"], result["arms"]
    t.add_row("accuracy", f"{pct(acc['a'])} ({arms['a']['n_correct']}/{acc['denominator_a']})",
              f"{pct(acc['b'])} ({arms['b']['n_correct']}/{acc['denominator_b']})", pts(acc["diff"]))
    for name, r in result["rates"].items():
        t.add_row(f"{name} rate", f"{pct(r['rate_a'])} ({r['n_a']})", f"{pct(r['rate_b'])} ({r['n_b']})", pts(r["diff"]))
    sp = result["spec"]
    t.add_row("accept length (mean)", num(sp["a"]["accept_length_mean"]), num(sp["b"]["accept_length_mean"]), "")
    t.add_row("acceptance rule", escape(acceptance(sp["a"])), escape(acceptance(sp["b"])), "")
    if sp["a"].get("server_metrics") or sp["b"].get("server_metrics"):
        t.add_row("accept length (run-level, /metrics)", num(sp["a"].get("accept_length_run_level")),
                  num(sp["b"].get("accept_length_run_level")), "")
    sd = result["speed"]
    t.add_row("latency median (s)", num(sd["a"]["latency_median_s"]), num(sd["b"]["latency_median_s"]), "")
    t.add_row("tokens/s median", num(sd["a"]["tokens_per_s_median"], 1), num(sd["b"]["tokens_per_s_median"], 1), "")
    console.print(t)
    for line in headline_lines(result):
        console.print(line)
    flips = result.get("flips") or []
    if flips:
        ft = Table(title=f"flips ({len(flips)})")
        for col in ("id", "dir", "expected", "answer A", "answer B", "finish A/B", "tokens A/B", "diverge"):
            ft.add_column(col)
        for f in flips:
            cells = (f["question_id"], f["direction"], f["expected_answer"], f["answer_a"], f["answer_b"],
                     f"{f['finish_reason_a']}/{f['finish_reason_b']}", f"{f['tokens_a']}/{f['tokens_b']}",
                     f["divergence_position"])
            ft.add_row(*(escape(str(c)) for c in cells))
        console.print(ft)


def headline_lines(result: dict, details: bool = True) -> list[str]:
    """The few sentences that answer "did anything move". Without `details` the manifest differences are only
    counted (report.html lists them in their own table)."""
    lines = []
    if result.get("forced"):
        lines.append("[bold red]FORCED[/]: compared despite: " + escape("; ".join(result["forced_over"])))
    for arm in ("a", "b"):
        sp = (result.get("spec") or {}).get(arm) or {}
        if sp.get("lossy"):
            lines.append(f"[bold yellow]LOSSY acceptance[/] in {escape(label(result, arm))}: "
                         f"{escape(lossy_detail(sp))}; its accuracy measures that rule")
    g = result.get("greedy")
    if g:
        lines.extend(greedy_lines(g))
    r = result.get("repeated_stats")
    if r:
        lines.append(repeated_line(r))
    ag = result.get("agreement") or {}
    if "n_pairs" in ag:
        lines.append(
            f"output agreement: {ag['n_identical']}/{ag['n_pairs']} identical ({pct(ag['share_identical'])}) by "
            f"{', '.join(f'{BASIS_LABELS.get(k, k)} {v}' for k, v in ag['basis_counts'].items()) or 'n/a'}; first divergence median "
            f"{num(ag['first_divergence_median'], 1)}; logprob gap median {num(ag['logprob_gap_median'])}")
        if ag.get("n_identical_tokens_but_text_differs"):
            lines.append(f"[bold red]warning[/]: {ag['n_identical_tokens_but_text_differs']} pair(s) have identical "
                         "token ids but different text (server detokenization or record fault)")
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
        lines.append(f"manifest: {len(md['differences'])} difference(s), {md['n_intended']} marked intended, "
                     f"{unintended}" + escape(folded) + (":" if details else " (see Manifest differences)"))
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
        lines.append(
            f"outputs {ident['basis']}-identical in all {ident['n_pairs']} pairs: the rate of differing outputs is at "
            f"most {pct(ident['discordance_upper_bound'])} (exact one-sided {int(100 * ident['confidence'])}% bound), "
            f"so B - A is at least {pts(-ident['discordance_upper_bound'])}")
    iv, bs = g["interval"], g["bootstrap"]
    lines.append(
        f"greedy: B right/A wrong = {g['b_only']}, A right/B wrong = {g['a_only']} of {g['n']}; "
        f"exact McNemar p = {g['mcnemar_p']:.4g}; {int(100 * iv['confidence'])}% CI of B - A by {iv['method']} "
        f"[{pts(iv['low'])}, {pts(iv['high'])}]; "
        f"non-inferiority at -{g['margin_pts']} pt: [bold]{g['verdict']}[/]"
        + (f"; [bold red]no information[/]: {escape(g['verdict_note'])}" if g.get("verdict_note") else ""))
    lines.append(f"greedy power: {mde_sentence(g)}; paired bootstrap {int(100 * bs['confidence'])}% CI "
                 f"[{pts(bs['ci_low'])}, {pts(bs['ci_high'])}] ({bs['n_resamples']} resamples, seed {bs['seed']}; "
                 "secondary: it collapses to a point when nothing flips)")
    return lines


def mde_sentence(g: dict) -> str:
    """'smallest detectable drop 7.98 pt (...); -1 pt needs 3823 questions (...)' for a greedy comparison."""
    plan = g["planning_discordance"]
    if g.get("mde_pts") is None:
        return "smallest detectable drop n/a (no pairs)"
    needed = g.get("n_needed_for_margin")
    needed = "n/a" if needed is None else needed
    return (f"smallest detectable drop {g['mde_pts']:.2f} pt (80% power, alpha 0.05, {g['n']} questions, "
            f"discordance {pct(plan['rate'])}: {plan['basis']}); -{g['margin_pts']:g} pt needs "
            f"{needed} questions at that discordance, {g['n_needed_if_no_flips']} if none flips")


def verdict_summary(g: dict) -> str:
    """One clause for a one-line summary (evalpipe ab): identity, interval, verdict, and when the margin is out of
    reach, how many questions it would take."""
    iv, plan, ident = g["interval"], g["planning_discordance"], g.get("output_identity") or {}
    parts = []
    if ident.get("all_identical"):
        parts.append(f"outputs {ident['basis']}-identical in all {ident['n_pairs']} pairs (differing-output rate "
                     f"<= {pct(ident['discordance_upper_bound'])}, exact one-sided {int(100 * ident['confidence'])}%)")
    margin = f"-{g['margin_pts']:g} pt"
    parts.append(f"Tango {int(100 * iv['confidence'])}% CI of B - A [{pts(iv['low'])}, {pts(iv['high'])}]: "
                 f"{g['verdict']} at {margin}")
    if g.get("verdict_note"):
        return "; ".join(parts + [f"no information: {g['verdict_note']}"])
    if g.get("mde_pts") is None:
        return "; ".join(parts)
    mde = f"smallest detectable drop {g['mde_pts']:.2f} pt"
    needed = g.get("n_needed_for_margin")
    if g["verdict"] == "non-inferior" or needed is None or needed <= g["n"]:
        parts[-1] += f" ({mde})"
    elif plan["basis"] == "observed":
        parts.append(f"{g['n']} questions cannot support {margin} ({mde}): that needs {needed} questions at the "
                     f"observed {pct(plan['rate'])} discordance")
    else:
        parts.append(f"{g['n']} questions cannot support {margin} ({mde}): that needs {g['n_needed_if_no_flips']} "
                     f"questions if none flips, {needed} at the {pct(plan['rate'])} discordance bound")
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
        + (f"{need_k} repeats per question at these questions" if need_k is not None
           else "more questions (no number of repeats suffices at these questions)")
        + (f"; [bold red]no information[/]: {escape(r['note'])}" if r.get("note") else ""))


def speed_overlap_line(result: dict) -> str | None:
    """A run comparison's tokens/s are lane responses of varying length: when the arms' samples overlap, say that
    attributing a gain needs a bench."""
    sd = result.get("speed") or {}
    va, vb = (sd.get("a") or {}).get("tokens_per_s") or [], (sd.get("b") or {}).get("tokens_per_s") or []
    if not (va and vb) or min(va) > max(vb) or min(vb) > max(va):
        return None
    return ("speed: the tokens/s samples of A and B overlap; attributing a gain needs a fixed-input, warmed, repeated "
            "comparison (evalpipe bench on each arm, then evalpipe compare on the two bench folders)")


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
    params = ", ".join(f"{k}={v}" for k, v in (server or {}).items()
                       if k not in ("rule", "lossy", "applies_to"))
    return (f"{rule}{f' ({params})' if params else ''}: "
            f"{sp.get('n_records_lossy', 0)}/{sp.get('n_records_with_spec', 0)} responses report a lossy decision")


def _short(v: Any, n: int = 80) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


BENCH_COLUMNS = ("metric", "median A", "median B", "B / A", "95% CI", "verdict", "MDE", "n A", "n B")
THROUGHPUT = "decode_tokens_per_s"


def bench_rows(result: dict) -> list[list]:
    return [[name, num(m.get("median_a")), num(m.get("median_b")), num(m.get("ratio")),
             f"[{num(m.get('ci_low'))}, {num(m.get('ci_high'))}]", m.get("verdict", "n/a"),
             "n/a" if m.get("mde_pct") is None else f"{m['mde_pct']:.1f}%", m.get("n_a"), m.get("n_b")]
            for name, m in result["metrics"].items()]


def bench_headline(result: dict) -> list[str]:
    """The throughput verdict with its MDE, and the overlap warning when the two arms' samples intersect."""
    m = result["metrics"].get(THROUGHPUT)
    if not m:
        return []
    mde = "n/a (fewer than 2 values in an arm)" if m.get("mde_pct") is None else f"{m['mde_pct']:.1f}%"
    lines = [f"throughput ({THROUGHPUT}): B / A = {num(m.get('ratio'))}, {int(100 * m.get('confidence', 0.95))}% CI "
             f"[{num(m.get('ci_low'))}, {num(m.get('ci_high'))}]: [bold]{m.get('verdict')}[/]; smallest detectable "
             f"change {mde} (80% power, alpha 0.05)"]
    if m.get("samples_overlap"):
        lines.append("the throughput samples of A and B overlap: attributing a gain needs a fixed-input, warmed, "
                     "repeated comparison (same --seed inputs, warm-up rounds dropped, --rounds 5 or more per arm, "
                     "arms interleaved)")
    return lines


FEW_BENCH_VALUES = 5  # below it, resampling 2-4 values mostly reshuffles the same few medians


def _print_bench(result: dict, console: Console) -> None:
    t = Table(title="evalpipe compare — bench (ratio of medians B / A)")
    for col in BENCH_COLUMNS:
        t.add_column(col, no_wrap=col in ("metric", "95% CI"))
    for row in bench_rows(result):
        t.add_row(*map(str, row))
    console.print(t)
    for line in bench_headline(result):
        console.print(line)
    few = min((min(m.get("n_a") or 0, m.get("n_b") or 0) for m in result["metrics"].values()), default=0)
    if few < FEW_BENCH_VALUES:
        console.print(f"note: only {few} measured value(s) in an arm: a bootstrap interval over so few values is far "
                      f"narrower than the real uncertainty (bench --rounds {FEW_BENCH_VALUES} or more)")
    if result.get("forced"):
        console.print("[bold red]FORCED[/]: compared despite: " + escape("; ".join(result["forced_over"])))


# ----------------------------------------------------------------------------- plots

def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plot_per_question(result: dict) -> str:
    """Per-question accuracy, A on x and B on y: rates for repeated lanes, jittered 0/1 for greedy ones."""
    fig, ax = plt.subplots(figsize=(5, 5))
    if result.get("repeated_stats"):
        pq = result["repeated_stats"]["per_question"]
        xs = np.array([q["rate_a"] for q in pq])
        ys = np.array([q["rate_b"] for q in pq])
        ax.scatter(xs, ys, alpha=0.7, color=COLORS["b"])
        ax.plot([0, 1], [0, 1], color="gray", lw=0.8, ls="--")
        ax.set_xlim(-0.05, 1.05)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title("per-question success rate")
    else:
        pq = result.get("per_question") or []
        xs = np.array([float(q["correct_a"]) for q in pq])
        ys = np.array([float(q["correct_b"]) for q in pq])
        rng = np.random.default_rng(0)
        ax.scatter(xs + rng.uniform(-0.12, 0.12, xs.size), ys + rng.uniform(-0.12, 0.12, ys.size), s=10, alpha=0.5,
                   color=COLORS["b"])
        for x in (0, 1):
            for y in (0, 1):
                n = int(np.sum((xs == x) & (ys == y)))
                ax.annotate(f"n={n}", (x, y + 0.2), ha="center", fontsize=11, weight="bold")
        ax.set_xticks([0, 1], ["wrong", "right"])
        ax.set_yticks([0, 1], ["wrong", "right"])
        ax.set_title("per-question correctness (jittered)")
        ax.plot([-0.3, 1.3], [-0.3, 1.3], color="gray", lw=0.8, ls="--")
        ax.set_xlim(-0.3, 1.4)
        ax.set_ylim(-0.3, 1.4)
    ax.set_xlabel(label(result, "a"))
    ax.set_ylabel(label(result, "b"))
    return _png(fig)


def run_level_cell(metrics: dict | None) -> str:
    """Mean accept length with the counts it comes from (drafts, accepted tokens, per-position acceptance)."""
    if not isinstance(metrics, dict):
        return "-"
    if metrics.get("error"):
        return f"unavailable: {metrics['error']}"
    parts = [num(metrics.get("mean_accept_length"))]
    if "drafts" in metrics:
        per_pos = metrics.get("acceptance_per_position") or []
        parts.append(f"({metrics['accepted_tokens']} accepted of {metrics['draft_tokens']} draft tokens in "
                     f"{metrics['drafts']} drafts; per position " + ", ".join(f"{x:.2f}" for x in per_pos) + ")")
    elif "verify_calls" in metrics:
        parts.append(f"({metrics['generation_tokens']} tokens / {metrics['verify_calls']} verify calls)")
    return " ".join(parts)


def plot_accept_lengths(result: dict) -> str | None:
    sp = result["spec"]
    if not (sp["a"]["histogram"] or sp["b"]["histogram"]):
        return None
    keys = sorted({int(k) for arm in ("a", "b") for k in sp[arm]["histogram"]})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for i, arm in enumerate(("a", "b")):
        h = sp[arm]["histogram"]
        total = sum(h.values()) or 1
        ax.bar(np.array(keys) + (i - 0.5) * width, [h.get(str(k), 0) / total for k in keys], width=width,
               label=f"{label(result, arm)} (mean {num(sp[arm]['accept_length_mean'], 2)})", color=COLORS[arm])
    ax.set_xlabel("accept length (tokens per verify step)")
    ax.set_ylabel("share")
    ax.set_title("accept-length distribution")
    ax.legend(fontsize=8)
    return _png(fig)


def plot_latency(result: dict) -> str | None:
    sd = result["speed"]
    if not (sd["a"]["latency_s"] or sd["b"]["latency_s"]):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in ((axes[0], "latency_s", "latency (s)"), (axes[1], "tokens_per_s", "tokens/s per response")):
        vals = [v for arm in ("a", "b") for v in sd[arm][key]]
        if not vals:
            ax.set_visible(False)
            continue
        bins = np.histogram_bin_edges(vals, bins=30)
        for arm in ("a", "b"):
            if sd[arm][key]:
                ax.hist(sd[arm][key], bins=bins, alpha=0.55, label=label(result, arm), color=COLORS[arm])
        ax.set_title(title)
        ax.legend(fontsize=8)
    return _png(fig)


def plot_bench(result: dict) -> str:
    metrics = result["metrics"]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5))
    for ax, (name, m) in zip(np.atleast_1d(axes), metrics.items()):
        for i, arm in enumerate(("a", "b")):
            vals = m.get(f"values_{arm}") or []
            ax.scatter(np.full(len(vals), i) + np.linspace(-0.1, 0.1, len(vals)) if vals else [], vals,
                       color=COLORS[arm], alpha=0.8)
            if vals:
                ax.hlines(np.median(vals), i - 0.2, i + 0.2, color="black")
        ax.set_xticks([0, 1], ["A", "B"])
        ax.set_title(f"{name}: B/A {num(m.get('ratio'))}")
    return _png(fig)


# ----------------------------------------------------------------------------- HTML

CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
td{max-width:36em;overflow-wrap:anywhere}
th{background:#f0f0f0} .bad{color:#b00;font-weight:bold} .ok{color:#070} .muted{color:#777}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0} code{background:#f6f6f6}
"""


def _e(x: Any) -> str:
    if x is None:
        return "<span class='muted'>n/a</span>"
    if isinstance(x, float):
        return f"{x:.6g}"
    return html.escape(x if isinstance(x, str) else json.dumps(x, default=str))


def _img(b64: str | None, alt: str, cls: str) -> str:
    if b64 is None:
        return f"<p class='muted'>{html.escape(alt)}: nothing recorded.</p>"
    return f"<img class='{cls}' alt='{html.escape(alt)}' src='data:image/png;base64,{b64}'>"


def _table(headers: list[str], rows: list[list[Any]], table_id: str | None = None) -> str:
    tid = f" id='{table_id}'" if table_id else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c if isinstance(c, _Raw) else _e(c)}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


class _Raw(str):
    """Already-escaped HTML cell content."""


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


def _agreement_value(key: str, value: Any) -> Any:
    if key == "share_identical":
        return pct(value)
    if key == "basis_counts" and isinstance(value, dict):
        return ", ".join(f"{BASIS_LABELS.get(k, k)}: {v}" for k, v in value.items()) or None
    return value


def acceptance_html(result: dict) -> str:
    """Acceptance per draft position, both mean accept lengths and the context buckets (harness/acceptance.py), and
    the --accept-baseline check; empty when neither arm has speculative statistics."""
    arms = result.get("acceptance") or {}
    if not any(arms.values()):
        return ""
    rows = []
    for arm in ("a", "b"):
        p = arms.get(arm)
        if not p:
            rows.append([arm.upper(), "no speculative statistics", "", "", ""])
            continue
        rows.append([arm.upper(), p.get("source"), num(p.get("request_weighted_accept_length")),
                     num(p.get("token_weighted_accept_length")), " ".join(num(x) for x in p["per_position"])])
        for bucket, sub in (p.get("by_context_tokens") or {}).items():
            rows.append([f"{arm.upper()}, prompt tokens {bucket}", f"{sub['responses']} responses",
                         num(sub["request_weighted_accept_length"]), num(sub["token_weighted_accept_length"]),
                         " ".join(num(x) for x in sub["per_position"])])
    html = ("<h2>Acceptance</h2><p>Per position j: share of verify steps that accepted at least j drafts. "
            "Request-weighted: mean over responses of tokens per verify step; token-weighted: all tokens over all "
            "verify steps (long completions weigh more).</p>"
            + _table(["arm", "source", "accept length (request-weighted)", "accept length (token-weighted)",
                      "acceptance by position 1..G"], rows, "acceptance"))
    check = result.get("accept_baseline")
    if check:
        html += (f"<p id='accept-baseline'>B against the acceptance baseline (rtol {check['rtol']:g}): "
                 f"<b>{'REGRESSED: ' + _e(check['reason']) if check['regressed'] else 'within tolerance'}</b></p>"
                 + _table(["position", "baseline", "measured", "relative change", "regressed"],
                          [[r["position"], num(r["baseline"]), num(r["measured"]), num(r["relative_change"]),
                            r["regressed"]] for r in check["positions"]]))
    return html


def render_html(result: dict) -> str:
    if result["kind"] == "bench":
        return _render_bench_html(result)
    a, b = result["arms"]["a"], result["arms"]["b"]
    parts = [f"<h1>evalpipe compare — lane {_e(result.get('lane'))}</h1>"]
    parts.append(_table(["arm", "folder", "run id", "label"],
                        [["A (reference)", a["path"], a["run_id"], a["arm"]], ["B (candidate)", b["path"], b["run_id"], b["arm"]]]))
    parts.append("<h2>Headline</h2><ul>" + "".join(
        f"<li>{_Raw(_rich_to_html(line))}</li>" for line in headline_lines(result, details=False)) + "</ul>")
    acc = result["accuracy"]
    rows = [["accuracy", f"{pct(acc['a'])} ({a['n_correct']}/{acc['denominator_a']})",
             f"{pct(acc['b'])} ({b['n_correct']}/{acc['denominator_b']})", pts(acc["diff"]), ""]]
    for name, r in result["rates"].items():
        rows.append([f"{name} rate", f"{pct(r['rate_a'])} ({r['n_a']}/{r['denominator_a']})",
                     f"{pct(r['rate_b'])} ({r['n_b']}/{r['denominator_b']})", pts(r["diff"]),
                     num(r.get("mcnemar_p"), 4) if r.get("mcnemar_p") is not None else ""])
    sp, sd = result["spec"], result["speed"]
    rows.append(["accept length mean / token-weighted",
                 f"{num(sp['a']['accept_length_mean'])} / {num(sp['a']['accept_length_token_weighted'])}",
                 f"{num(sp['b']['accept_length_mean'])} / {num(sp['b']['accept_length_token_weighted'])}", "", ""])
    rows.append(["acceptance rule", acceptance(sp["a"]), acceptance(sp["b"]), "", ""])
    if sp["a"].get("server_metrics") or sp["b"].get("server_metrics"):
        rows.append(["accept length run-level (server /metrics counters, not per request)",
                     run_level_cell(sp["a"].get("server_metrics")), run_level_cell(sp["b"].get("server_metrics")), "", ""])
    rows.append(["latency median / p90 (s)", f"{num(sd['a']['latency_median_s'])} / {num(sd['a']['latency_p90_s'])}",
                 f"{num(sd['b']['latency_median_s'])} / {num(sd['b']['latency_p90_s'])}", "", ""])
    rows.append(["tokens/s median / aggregate",
                 f"{num(sd['a']['tokens_per_s_median'], 1)} / {num(sd['a']['tokens_per_s_aggregate'], 1)}",
                 f"{num(sd['b']['tokens_per_s_median'], 1)} / {num(sd['b']['tokens_per_s_aggregate'], 1)}", "", ""])
    parts.append("<h2>Per arm</h2>" + _table(["", "A", "B", "B - A", "exact McNemar p"], rows, "arms"))
    g = result.get("greedy")
    if g:
        bs, iv = g["bootstrap"], g["interval"]
        parts.append("<h2>Greedy paired statistics</h2>" + _table(["quantity", "value"], [
            ["questions paired", g["n"]], ["both right / both wrong", f"{g['both_right']} / {g['both_wrong']}"],
            ["B right, A wrong (gained)", g["b_only"]], ["A right, B wrong (lost)", g["a_only"]],
            ["difference B - A", pts(g["diff"])], ["exact McNemar p (two-sided)", num(g["mcnemar_p"], 4)],
            [f"{int(100 * iv['confidence'])}% CI of B - A ({iv['method']})", f"[{pts(iv['low'])}, {pts(iv['high'])}]"],
            [f"non-inferiority (margin {g['margin_pts']} pt)", g["verdict"]],
            ["smallest detectable drop, questions needed", mde_sentence(g)],
            [f"paired bootstrap {int(100 * bs['confidence'])}% CI (secondary)",
             f"[{pts(bs['ci_low'])}, {pts(bs['ci_high'])}]"],
            ["bootstrap resamples / seed", f"{bs['n_resamples']} / {bs['seed']}"]]
            + ([["information", _Raw(f"<span class='bad'>none: {html.escape(g['verdict_note'])}</span>")]]
               if g.get("verdict_note") else []), "greedy"))
    r = result.get("repeated_stats")
    if r:
        pt = r["permutation_test"]
        parts.append("<h2>Repeated-lane statistics</h2>" + _table(["quantity", "value"], [
            ["questions", r["n_questions"]], ["responses A / B", f"{r['n_responses_a']} / {r['n_responses_b']}"],
            ["mean per-question rate A / B", f"{pct(r['mean_rate_a'])} / {pct(r['mean_rate_b'])}"],
            ["difference B - A", pts(r["diff"])], ["SE, fixed questions", spts(r["se_fixed_question"])],
            ["SE, question-clustered", spts(r["se_clustered"])],
            [f"{int(100 * r['interval']['confidence'])}% CI of B - A ({r['interval']['method']})",
             f"[{pts(r['interval']['ci_low'])}, {pts(r['interval']['ci_high'])}]"],
            [f"non-inferiority (margin {r['interval']['margin_pts']} pt)", r["interval"]["verdict"]],
            ["smallest detectable drop (80% power, alpha 0.05)",
             "n/a" if (r.get("power") or {}).get("mde_pts") is None else f"{r['power']['mde_pts']:.2f} pt"],
            ["questions needed for the margin (at these repeats)", (r.get("power") or {}).get("questions_needed_for_margin")],
            ["repeats per question needed (at these questions)", (r.get("power") or {}).get("repeats_needed_for_margin")],
            ["within-question permutation p", f"{num(pt['p_value'], 4)} ({pt['n_permutations']} permutations, seed {pt['seed']})"],
        ], "repeated"))
        parts.append("<h3>Per question</h3><p class='muted'>Fisher's exact test per question with Holm adjustment "
                     "is a flag for inspection, not the headline test.</p>" + _table(
            ["id", "A k/n", "B k/n", "rate A", "rate B", "B - A", "Fisher p (Holm)", "flag"],
            [[q["question_id"], f"{q['k_a']}/{q['n_a']}", f"{q['k_b']}/{q['n_b']}", pct(q["rate_a"]), pct(q["rate_b"]),
              pts(q["diff"]), num(q.get("fisher_p_holm"), 4), "FLAG" if q.get("flag") else ""]
             for q in r["per_question"]], "per-question"))
    parts.append("<h2>Plots</h2>")
    parts.append(_img(plot_per_question(result), "per-question accuracy A vs B", "plot plot-per-question"))
    parts.append(_img(plot_accept_lengths(result), "accept-length histograms", "plot plot-accept-length"))
    parts.append(_img(plot_latency(result), "latency distributions", "plot plot-latency"))
    parts.append(acceptance_html(result))
    ag = result.get("agreement") or {}
    parts.append("<h2>Output agreement</h2>")
    if "n_pairs" in ag:
        parts.append(_table(["quantity", "value"], [[AGREEMENT_LABELS.get(k, k.replace("_", " ")), _agreement_value(k, v)]
                                                    for k, v in ag.items()], "agreement"))
    else:
        parts.append(f"<p>{_e(ag.get('note'))}</p>")
    flips = result.get("flips") or []
    if not result.get("repeated_stats") and not flips:
        parts.append("<h2>Flip list (0)</h2><p id='no-flips'>No flips: every paired question is right in both arms "
                     "or wrong in both.</p>")
    elif not result.get("repeated_stats"):
        parts.append(f"<h2>Flip list ({len(flips)})</h2>")
        parts.append(_table(
            ["id", "direction", "expected", "answer A", "answer B", "finish A", "finish B", "tokens A", "tokens B",
             "first divergence", "logprob gap"],
            [[f["question_id"], f["direction"], f["expected_answer"], f["answer_a"], f["answer_b"], f["finish_reason_a"],
              f["finish_reason_b"], f["tokens_a"], f["tokens_b"], f["divergence_position"], f["logprob_gap"]]
             for f in flips], "flips"))
    md = result["manifest_diff"]
    parts.append("<h2>Manifest differences</h2>")
    parts.append(f"<p>Intended patterns: {_e(', '.join(md['intended_patterns']) or 'none given (use --intended)')}. "
                 f"{md['n_intended']} difference(s) marked intended, {md['n_unintended']} not marked intended."
                 + (f" {_e(md['intended_implied'][0].upper() + md['intended_implied'][1:])}." if md.get("intended_implied") else "")
                 + "</p>")
    if md["differences"]:
        parts.append(_table(["category", "key", "A", "B", "status"], [
            [d["category"], d["key"], d["a"], d["b"],
             _Raw("<span class='ok'>intended</span>" if d["intended"] else "<span class='bad'>not marked intended</span>")]
            for d in md["differences"]], "manifest-diff"))
    else:
        parts.append("<p id='manifest-diff'>No differences outside the volatile keys.</p>")
    ignored = md["volatile_keys_ignored"]
    parts.append(f"<details id='volatile-keys'><summary>Volatile keys ignored ({len(ignored)}): differ between any two "
                 "runs by construction (times, run ids, ports, command lines that restate the settings compared "
                 "above)</summary><p>" + (html.escape(", ".join(ignored)) or "none") + "</p></details>")
    if result.get("forced"):
        parts.insert(1, "<p class='bad'>FORCED comparison despite: " + html.escape("; ".join(result["forced_over"])) + "</p>")
    return _page("evalpipe compare", "".join(parts))


def _render_bench_html(result: dict) -> str:
    parts = ["<h1>evalpipe compare — bench</h1>",
             _table(["arm", "folder"], [["A", result["arms"]["a"]["path"]], ["B", result["arms"]["b"]["path"]]]),
             "<h2>Headline</h2><ul>" + "".join(f"<li>{_Raw(_rich_to_html(line))}</li>"
                                              for line in bench_headline(result)) + "</ul>",
             "<h2>Ratio of medians (B / A), unpaired bootstrap interval</h2>",
             _table(list(BENCH_COLUMNS), bench_rows(result), "bench"),
             _img(plot_bench(result), "per-request values", "plot plot-bench")]
    if result.get("forced"):
        parts.insert(1, "<p class='bad'>FORCED comparison despite: " + html.escape("; ".join(result["forced_over"])) + "</p>")
    return _page("evalpipe compare (bench)", "".join(parts))


def _rich_to_html(line: str) -> str:
    s = html.escape(line.replace("\\[", "["))
    return s.replace("[bold red]", "<b class='bad'>").replace("[bold]", "<b>").replace("[/]", "</b>")


def _page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")


def write_html(result: dict, out_dir: Path) -> Path:
    path = out_dir / "report.html"
    path.write_text(render_html(result), encoding="utf-8")
    return path
