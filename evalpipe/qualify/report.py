"""Views of a qualification: the terminal table (gate, requests, passed, failed, time) and report.html."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from evalpipe.console import make_console
from evalpipe.harness.server_facts import deterministic_label


def print_table(result: dict) -> None:
    endpoint = result["endpoint"]
    deterministic = deterministic_label(endpoint.get("deterministic"))
    t = Table(
        title=escape(f"evalpipe qualify  {endpoint['model']}  {endpoint['base_url']}  deterministic {deterministic}")
    )
    for col, justify in (
        ("gate", "left"),
        ("verdict", "left"),
        ("requests", "right"),
        ("passed", "right"),
        ("failed", "right"),
        ("time", "right"),
        ("reason", "left"),
    ):
        t.add_column(col, justify=justify, overflow="fold")  # a reason wraps, whole, never cut
    for g in result["gates"]:
        colour = {"pass": "green", "skipped": "yellow"}.get(g["verdict"], "red")
        t.add_row(
            g["gate"],
            f"[{colour}]{g['verdict']}[/]",
            str(g["requests"]),
            str(g["passed"]),
            str(g["failed"]),
            f"{g['wall_s']:.1f}s",
            escape(g["reason"] or g["notes"].get("summary", "")),
        )
    console = make_console()
    console.print(t)
    console.print(f"verdict: {result['verdict']} (exit {result['exit_code']}); folder {result['out_dir']}")


def _e(x: Any) -> str:
    return html.escape(x if isinstance(x, str) else json.dumps(x, default=str))


def _rows(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def pit_histogram(notes: dict) -> str:
    """The sampling gate's PIT histogram as bars (flat at the dashed line for a correct sampler), else nothing."""
    counts = notes.get("pit_histogram") if isinstance(notes, dict) else None
    if not counts:
        return ""
    top, flat = max(counts), sum(counts) / len(counts)
    bars = "".join(
        f"<div title='u in [{i / len(counts):.2f}, {(i + 1) / len(counts):.2f}): {c}' style='display:"
        f"inline-block;vertical-align:bottom;width:14px;margin-right:1px;background:#58a;height:"
        f"{100 * c / top:.0f}px'></div>"
        for i, c in enumerate(counts)
    )
    return (
        f"<p><b>sampling</b>: PIT histogram of {sum(counts)} sampled tokens, {len(counts)} bins from u = 0 "
        f"(argmax first) to 1 (unreported tail last); a correct sampler is flat at {flat:.0f} per bin "
        f"(dashed)</p><div style='position:relative;height:100px;border-bottom:1px solid #999'>{bars}"
        f"<div style='position:absolute;left:0;width:{15 * len(counts)}px;bottom:{100 * flat / top:.0f}px;"
        "border-top:1px dashed #b00'></div></div>"
    )


def render_html(result: dict) -> str:
    gates = result["gates"]
    summary = _rows(
        ["gate", "verdict", "requests", "passed", "failed", "time (s)", "reason"],
        [[g["gate"], g["verdict"], g["requests"], g["passed"], g["failed"], g["wall_s"], g["reason"]] for g in gates],
    )
    sections = []
    for g in gates:
        failed = [r for r in g["records"] if r["verdict"] != "pass"]
        shown = failed[:50] if failed else g["records"][:20]
        rows = [
            [
                r["id"],
                r["verdict"],
                "; ".join(f"{'ok' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}" for c in r["checks"]),
            ]
            for r in shown
        ]
        sections.append(
            f"{pit_histogram(g['notes'])}<details{' open' if g['verdict'] not in ('pass', 'skipped') else ''}>"
            f"<summary><b>{_e(g['gate'])}</b>: {_e(g['verdict'])}"
            f" ({g['passed']}/{g['requests']} passed)</summary><p class='muted'>notes: {_e(g['notes'])}</p>"
            f"<p>{'failed requests' if failed else 'first requests'} (all of them are in qualify.json):</p>"
            + _rows(["request", "verdict", "checks"], rows)
            + "</details>"
        )
    verdict_class = "good" if result["verdict"] == "pass" else "bad"
    body = (
        f"<h1>evalpipe qualify</h1><p>{_e(result['endpoint'])}</p>"
        f"<section id='qualification'><h2>Qualification: <span class='{verdict_class}'>{_e(result['verdict'])}"
        f"</span></h2>{summary}{''.join(sections)}</section>"
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>evalpipe qualify</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse;margin:.5em 0}"
        "td,th{border:1px solid #ccc;padding:.2em .5em;font-size:90%;vertical-align:top}"
        ".good{color:#080}.bad{color:#b00}.muted{color:#666;font-size:85%}</style></head><body>"
        + body
        + "</body></html>\n"
    )


def write_html(result: dict, out_dir: Path) -> Path:
    path = Path(out_dir) / "report.html"
    path.write_text(render_html(result), encoding="utf-8")
    return path
