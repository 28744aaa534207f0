"""`evalpipe compare RUN_A RUN_B`: did accuracy, outputs or speed move between two arms?

RUN_A is the reference (e.g. speculation off), RUN_B the candidate; every difference is B - A.
Writes compare.json, report.html and prints a table. Refuses runs that did not ask the same questions
the same way (or are partial) unless --force, which compare.json records.
"""

from __future__ import annotations

import sys

import click

from evalpipe.commands.errors import BadInput
from evalpipe.compare import stats
from evalpipe.compare.gate import FAIL_ON_HELP, GATE_FAILED_EXIT, parse_fail_on


@click.command(name="compare")
@click.argument("run_a", type=click.Path(exists=True, file_okay=False))
@click.argument("run_b", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--margin",
    "margin_pts",
    type=float,
    default=1.0,
    show_default=True,
    help="Non-inferiority margin in accuracy points: B is non-inferior when the 95% CI lower bound of "
    "B - A (Tango's score interval; repeated lanes: a t interval) is above -MARGIN. Pre-register it; "
    "`evalpipe plan` says how many questions it needs.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder for compare.json and report.html [default: beside the inputs, "
    "<their common folder>/compare/<A>__vs__<B>].",
)
@click.option(
    "--force",
    is_flag=True,
    help="Compare even when prompt streams, datasets or lane protocols differ or a run is partial; "
    "the overridden reasons are recorded in compare.json and shown in the report.",
)
@click.option(
    "--intended",
    "intended",
    multiple=True,
    metavar="PATTERN",
    help="Glob over dotted manifest keys (or their last part) naming the intended difference, e.g. "
    "'server.*spec*'. Repeatable. Differences not matched are flagged as not intended. Without it: the "
    "flags declared by the `evalpipe ab` plan both folders come from, else the speculation settings "
    "when the arms differ only there (said in one line).",
)
@click.option(
    "--seed",
    type=int,
    default=stats.DEFAULT_SEED,
    show_default=True,
    help="RNG seed of the bootstrap (a secondary figure) and the permutation test (recorded).",
)
@click.option(
    "--resamples",
    type=click.IntRange(min=100),
    default=stats.DEFAULT_RESAMPLES,
    show_default=True,
    help="Bootstrap resamples and permutations.",
)
@click.option("--no-html", is_flag=True, help="Skip report.html (compare.json and the table are still written).")
@click.option("--fail-on", "fail_on", default=None, metavar="VERDICTS", help=FAIL_ON_HELP)
@click.option(
    "--accept-baseline",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="An acceptance baseline (`evalpipe run ... --save-accept-baseline FILE`): RUN_B's acceptance at "
    "each draft position, and its token-weighted mean accept length, must be at least the baseline's x "
    "(1 - --accept-rtol); otherwise compare reports the regression and exits 4.",
)
@click.option(
    "--accept-rtol",
    type=click.FloatRange(0.0, 1.0),
    default=0.05,
    show_default=True,
    help="Relative tolerance of --accept-baseline (vLLM's acceptance-length test uses 0.05).",
)
def command(
    run_a, run_b, margin_pts, out_dir, force, intended, seed, resamples, no_html, fail_on, accept_baseline, accept_rtol
):
    """Compare RUN_A (reference) and RUN_B (candidate), two run folders of the same lane or two bench folders.

    Run folders: accuracy with denominators; for greedy lanes exact McNemar, Tango's score interval and the
    non-inferiority verdict it gives (a paired bootstrap beside it), the smallest detectable drop and the questions
    the margin needs, with the full flip list; for repeated lanes per-question rates, fixed-question and clustered
    standard errors, a t interval (Q - 1 df) with its verdict and MDE, and a within-question permutation test;
    output agreement; truncation, error and invalid rates; accept lengths; latency and tokens/s; manifest
    differences. Bench folders (bench.json): ratio of medians B / A with a bootstrap interval, a verdict (higher,
    lower, no measurable change) and the smallest detectable change in percent.

    \b
    Exit codes:
      0  compared (whatever the verdict, unless --fail-on)
      1  refused: the runs did not ask the same questions the same way, or one is partial (--force overrides)
      2  usage error (a bad --accept-baseline file included), or a folder that is not a run folder or holds a
         malformed file (named with its line)
      4  the verdict is one of --fail-on, or RUN_B's acceptance regressed below --accept-baseline
    """
    from evalpipe.compare import report
    from evalpipe.compare.bench_compare import is_bench_folder
    from evalpipe.compare.gate import verdict_of
    from evalpipe.compare.runfolder import RunFolderError
    from evalpipe.compare.workflow import MixedFolders, NotComparable, compare_runs
    from evalpipe.harness.acceptance import read_baseline

    gate = parse_fail_on(fail_on)
    if gate and (is_bench_folder(run_a) or is_bench_folder(run_b)):
        raise click.UsageError("--fail-on gates the accuracy verdict of two run folders, not bench folders")
    baseline = None
    if accept_baseline is not None:
        try:
            baseline = read_baseline(accept_baseline)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
    try:
        done = compare_runs(
            run_a,
            run_b,
            out=out_dir,
            margin_pts=margin_pts,
            force=force,
            intended=intended,
            seed=seed,
            n_resamples=resamples,
            html=not no_html,
            accept_baseline=baseline,
            accept_rtol=accept_rtol,
        )
    except MixedFolders as exc:
        raise click.UsageError(str(exc)) from None
    except RunFolderError as exc:
        raise BadInput(str(exc)) from None
    except NotComparable as exc:
        raise click.ClickException(str(exc)) from None
    report.print_terminal(done.result)
    click.echo(f"wrote {done.json_path}")
    if done.html_path is not None:
        click.echo(f"wrote {done.html_path}")
    check = done.result.get("accept_baseline")
    if check is not None:
        rates = ", ".join(
            f"{r['position']}: {r['measured'] if r['measured'] is None else round(r['measured'], 3)}"
            f" vs {r['baseline']:.3f}"
            for r in check["positions"]
        )
        click.echo(f"acceptance vs baseline (rtol {accept_rtol:g}), per position: {rates}")
        if check["regressed"]:
            click.echo(f"evalpipe compare: ACCEPTANCE REGRESSION: {check['reason']}", err=True)
            sys.exit(GATE_FAILED_EXIT)
    if gate:
        verdict = verdict_of(done.result)["verdict"]
        if verdict in gate:
            click.echo(
                f"gate: verdict {verdict} is in --fail-on {','.join(sorted(gate))}: exit {GATE_FAILED_EXIT}", err=True
            )
            sys.exit(GATE_FAILED_EXIT)
