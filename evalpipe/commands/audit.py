"""`evalpipe audit RUN_DIR`: rebuild prompts, re-grade, recompute the summary, check completeness and manifest."""

from __future__ import annotations

from pathlib import Path

import click

from evalpipe.commands.errors import BadInput


@click.command(name="audit")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder holding gsm8k/test.jsonl when the run's recorded dataset path is not present here.",
)
@click.option(
    "--grader-timeout",
    type=click.FloatRange(0.001),
    default=None,
    help="Hard per-answer grader timeout for re-grading (default: the run's own).",
)
@click.option(
    "--grader-workers",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Grader processes for AIME lanes.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar while re-grading.")
def command(run_dir, data_dir, grader_timeout, grader_workers, no_progress):
    """Re-check RUN_DIR from its raw records; print what differs and exit 1 when anything does.

    Checks: records (schema), prompts (rebuilt and hashed), grades (re-graded from raw text), complete (every
    planned item exactly once), summary (recomputed), manifest (start == end, pins). A partial run fails
    `complete`. A change of evalpipe's own source during the run is a warning only. A run folder made by
    `evalpipe import` is checked for what its source recorded (see `evalpipe import --help`).

    \b
    Exit codes:
      0  every check passed
      1  a check failed (printed)
      2  usage error, or not a run folder, or a file that cannot be read (named with its line)
    """
    from evalpipe.harness.audit import MAX_SHOWN, audit_run
    from evalpipe.harness.records import (
        MANIFEST_FILE,
        RESPONSES_FILE,
        SUMMARY_FILE,
        MalformedFile,
        read_json_object,
        read_records,
    )

    if not (run_dir / MANIFEST_FILE).exists():
        raise BadInput(f"{run_dir} is not a run folder (no {MANIFEST_FILE})")
    try:
        for name in (MANIFEST_FILE, SUMMARY_FILE):
            if (run_dir / name).exists():
                read_json_object(run_dir / name)
    except MalformedFile as exc:
        raise BadInput(str(exc)) from None
    read = read_records(run_dir / RESPONSES_FILE)
    if read.bad_lines:
        raise BadInput(read.first_bad(run_dir / RESPONSES_FILE))
    report = audit_run(
        run_dir,
        data_dir=data_dir,
        grader_timeout_s=grader_timeout,
        grader_workers=grader_workers,
        progress=not no_progress,
    )
    for c in report.checks:
        click.echo(f"{'OK  ' if c.ok else 'FAIL'} {c.name}")
        for p in c.problems[:MAX_SHOWN]:
            click.echo(f"       {p}")
        if len(c.problems) > MAX_SHOWN:
            click.echo(f"       ... and {len(c.problems) - MAX_SHOWN} more")
        for n in c.notes:
            click.echo(f"       note: {n}")
    for w in report.warnings:
        click.echo(f"WARN {w}")
    click.echo(f"audit {'passed' if report.ok else 'FAILED'}: {run_dir}")
    if not report.ok:
        raise SystemExit(1)
