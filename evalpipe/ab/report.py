"""The one-page A/B report: arms and receipts, the fairness checks, per-lane results, links to each pair's report.

Plain HTML with relative links, so the A/B folder can be zipped and opened anywhere; each pair's own
`report.html` (written by `evalpipe compare`, images inline) is linked and embedded in a collapsible frame. The
cells are built here; the layout is compare/report's `ab.html.jinja`, in the frame every report page shares.
"""

from __future__ import annotations

from pathlib import Path

from markupsafe import Markup, escape

from evalpipe.compare.analysis import arm_accept_length
from evalpipe.compare.report.page import render_page
from evalpipe.harness.server_facts import deterministic_label

COMPARISON_COLUMNS = [
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
]
VERDICT_CLASS = {"non-inferior": "ok", "inferior": "bad", "inconclusive": "bad"}


def _text(value) -> str:
    return "" if value is None else str(value)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _span(cls: str, text) -> Markup:
    return Markup("<span class='{}'>{}</span>").format(cls, _text(text))


def _code(text) -> Markup:
    return Markup("<code>{}</code>").format(_text(text))


def _link(href, text) -> Markup:
    return Markup("<a href='{}'>{}</a>").format(_text(href), _text(text))


def _accept(comparison: dict, side: str) -> str:
    mean, basis = arm_accept_length((comparison.get("spec") or {}).get(side))
    return "off" if mean is None else f"{mean:.2f}" + (" (run-level)" if basis != "per-record" else "")


def _verdict_cell(comparison: dict):
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
    return _span(VERDICT_CLASS.get(verdict, ""), verdict) + escape(at + ci)


def _arm_row(arm: dict, lanes: list[str]) -> list:
    runs = [
        _link(f"{arm['runs'][lane]}/summary.json", arm["runs"][lane]) if arm["runs"].get(lane) else "-"
        for lane in lanes
    ]
    return [
        arm["label"],
        arm["status"],
        deterministic_label(arm.get("deterministic")),
        _link(arm["receipt"], "receipt.json"),
        _link(arm["log"], "server.log"),
        *runs,
    ]


def _receipt_row(check: dict) -> list:
    result = (
        _span("ok", "same")
        if check["ok"]
        else Markup("<span class='bad'>{}</span>").format(Markup("<br>").join(escape(d) for d in check["differences"]))
    )
    return [check["arm"], check["against"], ", ".join(check["declared"]) or "nothing", result]


def _comparison_row(c: dict) -> list:
    pair = f"{c['a']} vs {c['b']}"
    if c.get("error"):
        return [c["lane"], c["kind"], pair, _span("bad", c["error"])] + [""] * (len(COMPARISON_COLUMNS) - 4)
    ties = c.get("ties") or {}
    agree_cls = "ok" if ties.get("agreement_with_ties") == 1.0 else "bad"
    diff = c.get("accuracy_diff")
    return [
        c["lane"],
        c["kind"],
        pair,
        f"{_pct(c.get('accuracy_a'))} / {_pct(c.get('accuracy_b'))}",
        "" if diff is None else f"{100 * diff:+.2f} pts",
        _verdict_cell(c),
        "-" if c.get("mde_pts") is None else f"{c['mde_pts']:.2f} pts",
        _text((c.get("greedy") or {}).get("mcnemar_p")),
        _span(agree_cls, _pct(ties.get("agreement"))),
        f"{ties.get('n_ties', '-')} / {ties.get('n_real_differences', '-')} / {ties.get('n_undecided', '-')}",
        _span(agree_cls, _pct(ties.get("agreement_with_ties"))),
        " / ".join(_accept(c, side) for side in ("a", "b")),
        _link(c["report"], "report") if c.get("report") else "-",
    ]


def render(index: dict) -> str:
    args = index.get("args", {})
    lanes = list(index.get("lanes", []))
    comparisons = index.get("comparisons", [])
    return render_page(
        "ab.html.jinja",
        "evalpipe A/B",
        status=_text(index.get("status")),
        order=_text(index.get("order")),
        lanes=lanes,
        started_at=_text(index.get("started_at")),
        finished_at=_text(index.get("finished_at")),
        error=index.get("error"),
        warnings=index.get("warnings", []),
        sides=[[side, _code(args.get(key))] for side, key in (("common", "common"), ("A", "A"), ("B", "B"))],
        declared=", ".join(index.get("declared_flags") or []),
        arms=[_arm_row(a, lanes) for a in index.get("arms", [])],
        receipt_checks=[_receipt_row(c) for c in index.get("receipt_checks", [])],
        tie_rule=index.get("tie_rule"),
        comparison_columns=COMPARISON_COLUMNS,
        comparisons=[_comparison_row(c) for c in comparisons],
        frames=[
            {"title": f"{c['lane']}: {c['a']} vs {c['b']} ({c['kind']})", "src": c["report"]}
            for c in comparisons
            if c.get("report")
        ],
    )


def write_report(out: Path, index: dict) -> Path:
    path = Path(out) / "report.html"
    tmp = path.with_suffix(".html.tmp")
    tmp.write_text(render(index))
    tmp.replace(path)
    return path
