"""The comparison as one self-contained report.html: the numbers are put in rows here, the layout is the jinja2
templates beside this file (`*.html.jinja`, shipped as package data), the plots are embedded as base64 PNGs
(plots.py), so the page opens offline from any folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader
from markupsafe import Markup, escape

from evalpipe.compare.report.text import (
    AGREEMENT_LABELS,
    BENCH_COLUMNS,
    acceptance,
    agreement_value,
    bench_headline,
    bench_rows,
    headline_lines,
    mde_sentence,
    num,
    pct,
    pts,
    run_level_cell,
    spts,
)

CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
td{max-width:36em;overflow-wrap:anywhere}
th{background:#f0f0f0} .bad{color:#b00;font-weight:bold} .ok{color:#070} .muted{color:#777}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0} code{background:#f6f6f6}
"""


def cell(x: Any) -> Markup:
    """A table cell: n/a for a missing value, 6 significant digits for a float, JSON for anything not a string;
    Markup passes as it is (cells this module built)."""
    if isinstance(x, Markup):
        return x
    if x is None:
        return Markup("<span class='muted'>n/a</span>")
    if isinstance(x, float):
        return escape(f"{x:.6g}")
    return escape(x if isinstance(x, str) else json.dumps(x, default=str))


def rich_to_html(line: str) -> Markup:
    """A headline sentence's rich markup (text.py) as tags: [bold] -> <b>, [bold red] -> <b class='bad'>."""
    s = str(escape(line.replace("\\[", "[")))
    return Markup(s.replace("[bold red]", "<b class='bad'>").replace("[bold]", "<b>").replace("[/]", "</b>"))


_ENV = Environment(
    loader=FileSystemLoader(Path(__file__).resolve().parent),
    autoescape=True,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
)
_ENV.filters["cell"] = cell
_ENV.filters["rich"] = rich_to_html


def render_html(result: dict) -> str:
    from evalpipe.compare.report import plots  # matplotlib: about a second of imports that --no-html never needs

    if result["kind"] == "bench":
        return _render(
            "bench.html.jinja",
            "evalpipe compare (bench)",
            result,
            arms=[["A", result["arms"]["a"]["path"]], ["B", result["arms"]["b"]["path"]]],
            headline_lines=bench_headline(result),
            bench_columns=list(BENCH_COLUMNS),
            bench_rows=bench_rows(result),
            plot=plots.plot_bench(result),
        )
    a, b = result["arms"]["a"], result["arms"]["b"]
    flips = (
        None
        if result.get("repeated_stats")
        else [
            [
                f["question_id"],
                f["direction"],
                f["expected_answer"],
                f["answer_a"],
                f["answer_b"],
                f["finish_reason_a"],
                f["finish_reason_b"],
                f["tokens_a"],
                f["tokens_b"],
                f["divergence_position"],
                f["logprob_gap"],
            ]
            for f in result.get("flips") or []
        ]
    )
    ag = result.get("agreement") or {}
    return _render(
        "compare.html.jinja",
        "evalpipe compare",
        result,
        lane=result.get("lane"),
        arms=[["A (reference)", a["path"], a["run_id"], a["arm"]], ["B (candidate)", b["path"], b["run_id"], b["arm"]]],
        headline_lines=headline_lines(result, details=False),
        per_arm=per_arm_rows(result),
        greedy=greedy_rows(result.get("greedy")),
        repeated=repeated_rows(result.get("repeated_stats")),
        per_question=per_question_rows(result.get("repeated_stats")),
        plots={
            "per_question": plots.plot_per_question(result),
            "accept_lengths": plots.plot_accept_lengths(result),
            "latency": plots.plot_latency(result),
        },
        acceptance=acceptance_section(result),
        agreement=[[AGREEMENT_LABELS.get(k, k.replace("_", " ")), agreement_value(k, v)] for k, v in ag.items()]
        if "n_pairs" in ag
        else None,
        agreement_note=ag.get("note"),
        flips=flips,
        manifest=manifest_section(result["manifest_diff"]),
    )


def write_html(result: dict, out_dir: Path) -> Path:
    path = out_dir / "report.html"
    path.write_text(render_html(result), encoding="utf-8")
    return path


def render_page(template: str, title: str, **context: Any) -> str:
    """One of the report templates beside this file in the page frame (the one place HTML is laid out)."""
    return _ENV.get_template(template).render(title=title, css=Markup(CSS), **context)


def _render(template: str, title: str, result: dict, **context: Any) -> str:
    forced = "; ".join(result["forced_over"]) if result.get("forced") else None
    return _ENV.get_template(template).render(title=title, css=Markup(CSS), forced_over=forced, **context)


def per_arm_rows(result: dict) -> list[list]:
    a, b = result["arms"]["a"], result["arms"]["b"]
    acc = result["accuracy"]
    rows = [
        [
            "accuracy",
            f"{pct(acc['a'])} ({a['n_correct']}/{acc['denominator_a']})",
            f"{pct(acc['b'])} ({b['n_correct']}/{acc['denominator_b']})",
            pts(acc["diff"]),
            "",
        ]
    ]
    for name, r in result["rates"].items():
        rows.append(
            [
                f"{name} rate",
                f"{pct(r['rate_a'])} ({r['n_a']}/{r['denominator_a']})",
                f"{pct(r['rate_b'])} ({r['n_b']}/{r['denominator_b']})",
                pts(r["diff"]),
                num(r.get("mcnemar_p"), 4) if r.get("mcnemar_p") is not None else "",
            ]
        )
    sp, sd = result["spec"], result["speed"]
    rows.append(
        [
            "accept length mean / token-weighted",
            f"{num(sp['a']['accept_length_mean'])} / {num(sp['a']['accept_length_token_weighted'])}",
            f"{num(sp['b']['accept_length_mean'])} / {num(sp['b']['accept_length_token_weighted'])}",
            "",
            "",
        ]
    )
    rows.append(["acceptance rule", acceptance(sp["a"]), acceptance(sp["b"]), "", ""])
    if sp["a"].get("server_metrics") or sp["b"].get("server_metrics"):
        rows.append(
            [
                "accept length run-level (server /metrics counters, not per request)",
                run_level_cell(sp["a"].get("server_metrics")),
                run_level_cell(sp["b"].get("server_metrics")),
                "",
                "",
            ]
        )
    rows.append(
        [
            "latency median / p90 (s)",
            f"{num(sd['a']['latency_median_s'])} / {num(sd['a']['latency_p90_s'])}",
            f"{num(sd['b']['latency_median_s'])} / {num(sd['b']['latency_p90_s'])}",
            "",
            "",
        ]
    )
    rows.append(
        [
            "tokens/s median / aggregate",
            f"{num(sd['a']['tokens_per_s_median'], 1)} / {num(sd['a']['tokens_per_s_aggregate'], 1)}",
            f"{num(sd['b']['tokens_per_s_median'], 1)} / {num(sd['b']['tokens_per_s_aggregate'], 1)}",
            "",
            "",
        ]
    )
    return rows


def greedy_rows(g: dict | None) -> list[list] | None:
    if not g:
        return None
    bs, iv = g["bootstrap"], g["interval"]
    rows = [
        ["questions paired", g["n"]],
        ["both right / both wrong", f"{g['both_right']} / {g['both_wrong']}"],
        ["B right, A wrong (gained)", g["b_only"]],
        ["A right, B wrong (lost)", g["a_only"]],
        ["difference B - A", pts(g["diff"])],
        ["exact McNemar p (two-sided)", num(g["mcnemar_p"], 4)],
        [f"{int(100 * iv['confidence'])}% CI of B - A ({iv['method']})", f"[{pts(iv['low'])}, {pts(iv['high'])}]"],
        [f"non-inferiority (margin {g['margin_pts']} pt)", g["verdict"]],
        ["smallest detectable drop, questions needed", mde_sentence(g)],
        [
            f"paired bootstrap {int(100 * bs['confidence'])}% CI (secondary)",
            f"[{pts(bs['ci_low'])}, {pts(bs['ci_high'])}]",
        ],
        ["bootstrap resamples / seed", f"{bs['n_resamples']} / {bs['seed']}"],
    ]
    if g.get("verdict_note"):
        rows.append(["information", Markup("<span class='bad'>none: {}</span>").format(g["verdict_note"])])
    return rows


def repeated_rows(r: dict | None) -> list[list] | None:
    if not r:
        return None
    pt, iv, power = r["permutation_test"], r["interval"], r.get("power") or {}
    return [
        ["questions", r["n_questions"]],
        ["responses A / B", f"{r['n_responses_a']} / {r['n_responses_b']}"],
        ["mean per-question rate A / B", f"{pct(r['mean_rate_a'])} / {pct(r['mean_rate_b'])}"],
        ["difference B - A", pts(r["diff"])],
        ["SE, fixed questions", spts(r["se_fixed_question"])],
        ["SE, question-clustered", spts(r["se_clustered"])],
        [
            f"{int(100 * iv['confidence'])}% CI of B - A ({iv['method']})",
            f"[{pts(iv['ci_low'])}, {pts(iv['ci_high'])}]",
        ],
        [f"non-inferiority (margin {iv['margin_pts']} pt)", iv["verdict"]],
        [
            "smallest detectable drop (80% power, alpha 0.05)",
            "n/a" if power.get("mde_pts") is None else f"{power['mde_pts']:.2f} pt",
        ],
        ["questions needed for the margin (at these repeats)", power.get("questions_needed_for_margin")],
        ["repeats per question needed (at these questions)", power.get("repeats_needed_for_margin")],
        [
            "within-question permutation p",
            f"{num(pt['p_value'], 4)} ({pt['n_permutations']} permutations, seed {pt['seed']})",
        ],
    ]


def per_question_rows(r: dict | None) -> list[list]:
    return [
        [
            q["question_id"],
            f"{q['k_a']}/{q['n_a']}",
            f"{q['k_b']}/{q['n_b']}",
            pct(q["rate_a"]),
            pct(q["rate_b"]),
            pts(q["diff"]),
            num(q.get("fisher_p_holm"), 4),
            "FLAG" if q.get("flag") else "",
        ]
        for q in (r or {}).get("per_question", [])
    ]


def acceptance_section(result: dict) -> dict | None:
    """Acceptance per draft position, both mean accept lengths and the context buckets (harness/acceptance.py), and
    the --accept-baseline check; None when neither arm has speculative statistics."""
    arms = result.get("acceptance") or {}
    if not any(arms.values()):
        return None
    rows = []
    for arm in ("a", "b"):
        p = arms.get(arm)
        if not p:
            rows.append([arm.upper(), "no speculative statistics", "", "", ""])
            continue
        rows.append(
            [
                arm.upper(),
                p.get("source"),
                num(p.get("request_weighted_accept_length")),
                num(p.get("token_weighted_accept_length")),
                " ".join(num(x) for x in p["per_position"]),
            ]
        )
        for bucket, sub in (p.get("by_context_tokens") or {}).items():
            rows.append(
                [
                    f"{arm.upper()}, prompt tokens {bucket}",
                    f"{sub['responses']} responses",
                    num(sub["request_weighted_accept_length"]),
                    num(sub["token_weighted_accept_length"]),
                    " ".join(num(x) for x in sub["per_position"]),
                ]
            )
    check = result.get("accept_baseline")
    if check:
        check = {
            "rtol": f"{check['rtol']:g}",
            "regressed": check["regressed"],
            "reason": check.get("reason"),
            "rows": [
                [r["position"], num(r["baseline"]), num(r["measured"]), num(r["relative_change"]), r["regressed"]]
                for r in check["positions"]
            ],
        }
    return {"rows": rows, "check": check}


def manifest_section(md: dict) -> dict:
    implied = md.get("intended_implied")
    return {
        "patterns": ", ".join(md["intended_patterns"]) or "none given (use --intended)",
        "n_intended": md["n_intended"],
        "n_unintended": md["n_unintended"],
        "implied": implied[0].upper() + implied[1:] if implied else None,
        "rows": [
            [
                d["category"],
                d["key"],
                d["a"],
                d["b"],
                Markup(
                    "<span class='ok'>intended</span>"
                    if d["intended"]
                    else "<span class='bad'>not marked intended</span>"
                ),
            ]
            for d in md["differences"]
        ],
        "volatile": md["volatile_keys_ignored"],
    }
