"""`evalpipe import lm-eval|sgl-eval SOURCE --out RUN`: another harness's output as an evalpipe run folder."""

from __future__ import annotations

from pathlib import Path

import click

from evalpipe.commands.errors import BadInput

_EXIT_CODES = """
    \b
    Exit codes:
      0  imported
      2  usage error, or SOURCE is missing a file, holds a file of another kind or a malformed one (named with its
         line), or RUN is not empty
"""

_OUT = click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The run folder to write (new, or an empty folder).",
)
_ARM = click.option(
    "--arm", default=None, help="Label of this arm in records and reports [default: the run id, <tool>-<task>-<date>]."
)


@click.group(name="import")
def command():
    """Turn another harness's output into an evalpipe run folder, for `evalpipe compare` and `evalpipe audit`.

    Records are keyed by the source's document id (lm-eval's doc_id, sgl-eval's id), so two imports of one task are
    paired question by question; a difference in task configuration or in the questions asked is refused by
    compare as for native runs. What the source did not record (finish reason, usage, latency, server facts, ...)
    is null in the records and listed in manifest.json under imported.not_recorded. Audit re-checks the imported
    folder: record hashes, counts, the source's own hashes and, where the grader is one evalpipe has, every grade.
    """


def _finish(load, out_dir: Path, arm) -> None:
    from evalpipe.harness.imports import ImportSourceError, write_run_folder

    try:
        imported = load()
        summary = write_run_folder(imported, out_dir, arm=arm)
    except ImportSourceError as exc:
        raise BadInput(str(exc)) from None
    except FileExistsError as exc:
        raise BadInput(str(exc)) from None
    acc = summary.get("accuracy")
    score = imported.source.get("source_score")
    click.echo(
        f"imported {summary['n_records']} records of {imported.lane} ({imported.tool} {imported.version}): "
        f"accuracy {'-' if acc is None else f'{100 * acc:.2f}%'}"
        + (f" (the source reported {100 * score:.2f}%)" if isinstance(score, (int, float)) else "")
    )
    click.echo(f"not recorded by the source: {', '.join(imported.not_recorded)}")
    click.echo(f"run folder: {out_dir}")


@command.command(
    name="lm-eval",
    help="""Import an lm-eval run: SOURCE is the --output_path folder of
    `lm_eval ... --log_samples` (or its results_<date>.json). One task and one filter per run folder; a 0/1 metric
    per document (exact_match, acc, ...) decides `correct`.
"""
    + _EXIT_CODES,
)
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@_OUT
@_ARM
@click.option("--task", default=None, help="Task to import when SOURCE holds samples of several.")
@click.option(
    "--filter",
    "filter_name",
    default=None,
    help="lm-eval filter whose responses are imported [default: the first in the samples file].",
)
@click.option(
    "--metric", default=None, help="Per-document 0/1 metric that decides `correct` [default: the task's first metric]."
)
def lm_eval(source, out_dir, arm, task, filter_name, metric):
    from evalpipe.harness.imports import lm_eval as importer

    _finish(lambda: importer.load(source, task=task, filter_name=filter_name, metric=metric), out_dir, arm)


@command.command(
    name="sgl-eval",
    help="""Import an sgl-eval run: SOURCE is its run folder
    (`<out-dir>/sgl_eval_<name>_<stamp>/`, holding metrics.json and output-rs<r>.jsonl per repeat r).
"""
    + _EXIT_CODES,
)
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@_OUT
@_ARM
def sgl_eval(source, out_dir, arm):
    from evalpipe.harness.imports import sgl_eval as importer

    _finish(lambda: importer.load(source), out_dir, arm)
