"""The one-page A/B report: arms and receipts, the fairness checks, per-lane results, links to each pair's report.

Plain HTML with relative links, so the A/B folder can be zipped and opened anywhere; each pair's own
`report.html` (written by `evalpipe compare`, images inline) is linked and embedded in a collapsible frame.
"""

from __future__ import annotations

import html
from pathlib import Path

from evalpipe.compare.analysis import arm_accept_length
from evalpipe.harness.server_facts import deterministic_label

STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}.ok{color:#176f2c}.bad{color:#b00020;font-weight:bold}code{background:#f6f6f6;padding:0 .2em}
iframe{width:100%;height:700px;border:1px solid #ccc}
"""


def _e(value) -> str:
    return html.escape("" if value is None else str(value))


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _accept(comparison: dict, side: str) -> str:
    mean, basis = arm_accept_length((comparison.get("spec") or {}).get(side))
    return "off" if mean is None else f"{mean:.2f}" + (" (run-level)" if basis != "per-record" else "")


VERDICT_CLASS = {"non-inferior": "ok", "inferior": "bad", "inconclusive": "bad"}


def _verdict_cell(comparison: dict) -> str:
    """'inconclusive at -1 pt (95% CI [-6.02, +6.02] pts)' coloured by verdict; '-' for a comparison without one."""
    verdict = comparison.get("verdict")
    if verdict is None:
        return "-"
    interval = (comparison.get("greedy") or {}).get("interval") or {}
    low, high = interval.get("low"), interval.get("high")
    if interval.get("method") is None:
        interval = (comparison.get("repeated") or {}).get("interval") or {}
        low, high = interval.get("ci_low"), interval.get("ci_high")
    ci = "" if low is None or high is None else f" (95% CI [{100 * low:+.2f}, {100 * high:+.2f}] pts)"
    margin = comparison.get("margin_pts")
    at = "" if margin is None else f" at -{margin:g} pt"
    return f"<span class='{VERDICT_CLASS.get(verdict, '')}'>{_e(verdict)}</span>{_e(at + ci)}"


def render(index: dict) -> str:
    status = index.get("status")
    cls = "ok" if status == "done" else "bad"
    parts = [
        f"<h1>evalpipe A/B</h1><p>Status: <span class='{cls}'>{_e(status)}</span>"
        f" &middot; order <code>{_e(index.get('order'))}</code> &middot; lanes {_e(', '.join(index.get('lanes', [])))}"
        f" &middot; started {_e(index.get('started_at'))} &middot; finished {_e(index.get('finished_at'))}</p>",
    ]
    if index.get("error"):
        parts.append(f"<pre class='bad'>{_e(index['error'])}</pre>")
    for warning in index.get("warnings", []):
        parts.append(f"<p class='bad'>warning: {_e(warning)}</p>")
    args = index.get("args", {})
    parts.append(
        "<h2>Arms</h2>"
        + _table(
            ["side", "server arguments"],
            [
                ["common", f"<code>{_e(args.get('common'))}</code>"],
                ["A", f"<code>{_e(args.get('A'))}</code>"],
                ["B", f"<code>{_e(args.get('B'))}</code>"],
            ],
        )
    )
    parts.append(
        f"<p>Declared difference (flags that differ between A and B): "
        f"<code>{_e(', '.join(index.get('declared_flags') or []) or 'none')}</code></p>"
    )
    parts.append(
        _table(
            ["arm", "status", "deterministic", "receipt", "server log", *index.get("lanes", [])],
            [
                [
                    _e(a["label"]),
                    _e(a["status"]),
                    _e(deterministic_label(a.get("deterministic"))),
                    f"<a href='{_e(a['receipt'])}'>receipt.json</a>",
                    f"<a href='{_e(a['log'])}'>server.log</a>",
                    *[
                        f"<a href='{_e(a['runs'][lane])}/summary.json'>{_e(a['runs'][lane])}</a>"
                        if a["runs"].get(lane)
                        else "-"
                        for lane in index.get("lanes", [])
                    ],
                ]
                for a in index.get("arms", [])
            ],
        )
    )
    checks = index.get("receipt_checks", [])
    if checks:
        parts.append(
            "<h2>Receipt checks</h2>"
            + _table(
                ["arm", "against", "allowed to differ", "result"],
                [
                    [
                        _e(c["arm"]),
                        _e(c["against"]),
                        _e(", ".join(c["declared"]) or "nothing"),
                        "<span class='ok'>same</span>"
                        if c["ok"]
                        else "<span class='bad'>" + "<br>".join(_e(d) for d in c["differences"]) + "</span>",
                    ]
                    for c in checks
                ],
            )
        )
    comparisons = index.get("comparisons", [])
    if comparisons:
        parts.append(f"<h2>Comparisons</h2><p>Tie rule: {_e(index.get('tie_rule'))}.</p>")
        rows = []
        for c in comparisons:
            ties = c.get("ties") or {}
            greedy = c.get("greedy") or {}
            if c.get("error"):
                rows.append(
                    [
                        _e(c["lane"]),
                        _e(c["kind"]),
                        _e(f"{c['a']} vs {c['b']}"),
                        f"<span class='bad'>{_e(c['error'])}</span>",
                    ]
                    + [""] * 9
                )
                continue
            agree_cls = "ok" if ties.get("agreement_with_ties") == 1.0 else "bad"
            rows.append(
                [
                    _e(c["lane"]),
                    _e(c["kind"]),
                    _e(f"{c['a']} vs {c['b']}"),
                    f"{_pct(c.get('accuracy_a'))} / {_pct(c.get('accuracy_b'))}",
                    _e(None if c.get("accuracy_diff") is None else f"{100 * c['accuracy_diff']:+.2f} pts"),
                    _verdict_cell(c),
                    _e("-" if c.get("mde_pts") is None else f"{c['mde_pts']:.2f} pts"),
                    _e(greedy.get("mcnemar_p")),
                    f"<span class='{agree_cls}'>{_pct(ties.get('agreement'))}</span>",
                    _e(
                        f"{ties.get('n_ties', '-')} / {ties.get('n_real_differences', '-')} / "
                        f"{ties.get('n_undecided', '-')}"
                    ),
                    f"<span class='{agree_cls}'>{_pct(ties.get('agreement_with_ties'))}</span>",
                    _e(" / ".join(_accept(c, side) for side in ("a", "b"))),
                    f"<a href='{_e(c.get('report'))}'>report</a>" if c.get("report") else "-",
                ]
            )
        parts.append(
            _table(
                [
                    "lane",
                    "kind",
                    "pair",
                    "accuracy",
                    "B - A",
                    "verdict",
                    "smallest detectable drop",
                    "McNemar p",
                    "identical outputs",
                    "ties / real / undecided",
                    "agreement incl. ties",
                    "accept length",
                    "pair report",
                ],
                rows,
            )
        )
        for c in comparisons:
            if c.get("report"):
                parts.append(
                    f"<details><summary>{_e(c['lane'])}: {_e(c['a'])} vs {_e(c['b'])} ({_e(c['kind'])})</summary>"
                    f"<iframe src='{_e(c['report'])}' loading='lazy'></iframe></details>"
                )
    head = f"<!doctype html><html><head><meta charset='utf-8'><title>evalpipe A/B</title><style>{STYLE}</style></head>"
    return f"{head}<body>{''.join(parts)}</body></html>"


def write_report(out: Path, index: dict) -> Path:
    path = Path(out) / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(index))
    tmp.replace(path)
    return path
