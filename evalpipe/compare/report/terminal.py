"""The comparison as rich tables on the terminal (`evalpipe compare`, `evalpipe ab`)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from evalpipe.compare.report.text import (
    BENCH_COLUMNS,
    acceptance,
    bench_headline,
    bench_rows,
    headline_lines,
    label,
    num,
    pct,
    pts,
)
from evalpipe.console import make_console
from evalpipe.harness.server_facts import deterministic_label


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
    t.add_row(
        "accuracy",
        f"{pct(acc['a'])} ({arms['a']['n_correct']}/{acc['denominator_a']})",
        f"{pct(acc['b'])} ({arms['b']['n_correct']}/{acc['denominator_b']})",
        pts(acc["diff"]),
    )
    for name, r in result["rates"].items():
        t.add_row(
            f"{name} rate", f"{pct(r['rate_a'])} ({r['n_a']})", f"{pct(r['rate_b'])} ({r['n_b']})", pts(r["diff"])
        )
    sp = result["spec"]
    t.add_row("accept length (mean)", num(sp["a"]["accept_length_mean"]), num(sp["b"]["accept_length_mean"]), "")
    t.add_row("acceptance rule", escape(acceptance(sp["a"])), escape(acceptance(sp["b"])), "")
    if sp["a"].get("server_metrics") or sp["b"].get("server_metrics"):
        t.add_row(
            "accept length (run-level, /metrics)",
            num(sp["a"].get("accept_length_run_level")),
            num(sp["b"].get("accept_length_run_level")),
            "",
        )
    det = result.get("deterministic") or {}
    t.add_row("deterministic", deterministic_label(det.get("a")), deterministic_label(det.get("b")), "")
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
            cells = (
                f["question_id"],
                f["direction"],
                f["expected_answer"],
                f["answer_a"],
                f["answer_b"],
                f"{f['finish_reason_a']}/{f['finish_reason_b']}",
                f"{f['tokens_a']}/{f['tokens_b']}",
                f["divergence_position"],
            )
            ft.add_row(*(escape(str(c)) for c in cells))
        console.print(ft)


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
        console.print(
            f"note: only {few} measured value(s) in an arm: a bootstrap interval over so few values is far "
            f"narrower than the real uncertainty (bench --rounds {FEW_BENCH_VALUES} or more)"
        )
    if result.get("forced"):
        console.print("[bold red]FORCED[/]: compared despite: " + escape("; ".join(result["forced_over"])))
