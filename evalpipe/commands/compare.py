"""`evalpipe compare RUN_A RUN_B`: did accuracy, outputs or speed move between two arms?

RUN_A is the reference (e.g. speculation off), RUN_B the candidate; every difference is B - A.
Writes compare.json, report.html and prints a table. Refuses runs that did not ask the same questions
the same way (or are partial) unless --force, which compare.json records.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import click

from evalpipe.compare import stats


def default_out(a: str, b: str) -> Path:
    """Beside the inputs: `<their common folder>/compare/<A>__vs__<B>` (results/gsm8k/compare/... for two gsm8k
    runs), whatever the current directory; B's folder when the two share nothing but the root."""
    def tag(p: Path) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", p.name) or "run"

    pa, pb = Path(a).resolve(), Path(b).resolve()
    parent = Path(os.path.commonpath([pa.parent, pb.parent]))
    if parent == Path(parent.anchor):
        parent = pb.parent
    return parent / "compare" / f"{tag(pa)}__vs__{tag(pb)}"


@click.command(name="compare")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False))
@click.option("--margin", "margin_pts", type=float, default=1.0, show_default=True,
              help="Non-inferiority margin in accuracy points: B is non-inferior when the CI lower bound of B - A "
                   "is above -MARGIN. Pre-register it.")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder for compare.json and report.html [default: beside the inputs, "
                   "<their common folder>/compare/<A>__vs__<B>].")
@click.option("--force", is_flag=True,
              help="Compare even when prompt streams, datasets or lane protocols differ or a run is partial; "
                   "the overridden reasons are recorded in compare.json and shown in the report.")
@click.option("--intended", "intended", multiple=True, metavar="PATTERN",
              help="Glob over dotted manifest keys (or their last part) naming the intended difference, e.g. "
                   "'server.*spec*'. Repeatable. Differences not matched are flagged as not intended.")
@click.option("--seed", type=int, default=stats.DEFAULT_SEED, show_default=True,
              help="RNG seed of the bootstrap and permutation test (recorded).")
@click.option("--resamples", type=click.IntRange(min=100), default=stats.DEFAULT_RESAMPLES, show_default=True,
              help="Bootstrap resamples and permutations.")
@click.option("--no-html", is_flag=True, help="Skip report.html (compare.json and the table are still written).")
def command(run_a, run_b, margin_pts, out_dir, force, intended, seed, resamples, no_html):
    """Compare RUN_A (reference) and RUN_B (candidate), two run folders of the same lane or two bench folders.

    Run folders: accuracy with denominators; for greedy lanes exact McNemar, a paired bootstrap interval
    and a non-inferiority verdict with the full flip list; for repeated lanes per-question rates, fixed-question
    and clustered standard errors and a within-question permutation test; output agreement; truncation,
    error and invalid rates; accept lengths; latency and tokens/s; manifest differences.
    Bench folders (bench.json): ratio of medians B / A with a bootstrap interval.
    """
    from evalpipe.compare import report
    from evalpipe.compare.bench_compare import bench_problems, compare_benches, is_bench_folder, load_bench
    from evalpipe.compare.runfolder import RunFolderError, comparability_problems, load_run

    bench_a, bench_b = is_bench_folder(run_a), is_bench_folder(run_b)
    try:
        if bench_a and bench_b:
            a, b = load_bench(run_a), load_bench(run_b)
            problems = bench_problems(a, b)
        elif bench_a or bench_b:
            raise click.UsageError("one folder is a bench folder (bench.json) and the other is not; compare like with like.")
        else:
            a, b = load_run(run_a), load_run(run_b)
            problems = comparability_problems(a, b)
    except RunFolderError as exc:
        raise click.ClickException(str(exc)) from exc
    if problems and not force:
        raise click.ClickException(
            "refusing to compare:\n  - " + "\n  - ".join(problems) + "\n(use --force to compare anyway; it is recorded)")
    if bench_a:
        result = compare_benches(a, b, seed=seed, n_resamples=resamples, forced=problems)
    else:
        from evalpipe.compare.analysis import analyse

        result = analyse(a, b, margin_pts=margin_pts, seed=seed, n_resamples=resamples, intended=list(intended),
                         forced=problems)
    out = Path(out_dir) if out_dir else default_out(run_a, run_b)
    out.mkdir(parents=True, exist_ok=True)
    result["command"] = {"run_a": str(run_a), "run_b": str(run_b), "margin_pts": margin_pts, "force": force,
                         "intended": list(intended), "seed": seed, "resamples": resamples}
    json_path = report.write_json(result, out)
    report.print_terminal(result)
    click.echo(f"wrote {json_path}")
    if not no_html:
        click.echo(f"wrote {report.write_html(result, out)}")
