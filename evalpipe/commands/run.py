"""`evalpipe run LANE --base-url URL`: run a lane, record every response, print the summary."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import click

from evalpipe.commands.errors import BadInput
from evalpipe.harness.client import DEFAULT_BASE_URL
from evalpipe.harness.lane_run import EXIT_CODES
from evalpipe.harness.prepare import LANE_OVERRIDES, PROTOCOL_OPTIONS, RunConfig
from evalpipe.lanes import LANE_MODULES, get_lane

# the run's defaults are RunConfig's (harness/prepare.py); the options below show them
DEFAULTS = {f.name: f.default for f in fields(RunConfig)}
HELP = """Run LANE against an OpenAI-compatible endpoint and write responses.jsonl, summary.json, manifest.json.

Every planned item lands exactly once: a final failure is an error record, never a dropped item.
Accuracy is over all planned items.

\b
Exit codes:
""" + "\n".join(f"  {code:<5}{meaning}" for code, meaning in EXIT_CODES)


def _parse_seed(ctx, param, value):
    if value is None:
        return None
    if str(value).lower() in ("none", "null", "unset"):
        return "none"
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter("an integer, or 'none' to send no seed") from None


@click.command(name="run", help=HELP)
@click.argument("lane", required=False, type=click.Choice(list(LANE_MODULES)))
@click.option(
    "--base-url",
    default=None,
    help=f"OpenAI-compatible endpoint including /v1. Default: "
    f"{DEFAULT_BASE_URL}, where `evalpipe serve` listens by default; with --resume the run's own endpoint "
    "(this flag overrides it).",
)
@click.option(
    "--model",
    default=None,
    help="Model id to request. Default: the first id from /v1/models. "
    "A name the server does not list is an error before any request.",
)
@click.option(
    "--api-key", envvar="EVALPIPE_API_KEY", default=None, help="Bearer key (env EVALPIPE_API_KEY). Never recorded."
)
@click.option(
    "--concurrency",
    "lane_concurrency",
    type=click.IntRange(1, 4096),
    default=None,
    help="Requests in flight. Default: the lane's ("
    + ", ".join(f"{name} {get_lane(name).concurrency}" for name in LANE_MODULES)
    + "). Recorded.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULTS["out_dir"],
    show_default=True,
    help="Parent folder; the run goes to <out>/<lane>/<run_id>/.",
)
@click.option(
    "--arm",
    default=DEFAULTS["arm"],
    show_default=True,
    help="Label of this arm (e.g. spec_on, spec_off); part of the run id and every record.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0.001),
    default=DEFAULTS["timeout_s"],
    show_default=True,
    help="Per-request timeout in seconds (a timeout is retried like a transport error). The default, "
    "4 h, is NeMo-Skills'/sgl-eval's: a 65536-token AIME answer can legitimately take hours.",
)
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="Override the lane's max_tokens.")
@click.option("--temperature", type=click.FloatRange(0.0), default=None, help="Override the lane's temperature.")
@click.option("--seed", callback=_parse_seed, default=None, help="Override the lane's seed; 'none' sends no seed.")
@click.option(
    "--sample-seeds",
    "sample_seeds",
    type=click.IntRange(0),
    default=None,
    metavar="BASE",
    help="Send each (question, repeat) its own seed derived from BASE: the first 8 bytes of SHA-256 of "
    "'evalpipe-sample-seed/v1:BASE:QUESTION_ID:REPEAT', shifted right one bit (in each record's request). Two arms "
    "run with the same BASE send the same seeds, so on a server whose sampled tokens depend only on the prompt and "
    "the seed (evalpipe serve --deterministic) `evalpipe compare` checks T > 0 outputs for identity. Identical "
    "outputs prove the change lossless on those paths in that engine (its sampler is keyed and its speculative "
    "verify replays the plain tokens); they say nothing of another engine's rejection sampler. Not with --seed.",
)
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=None, help="Override the lane's top_p.")
@click.option("--num-examples", type=click.IntRange(1), default=None, help="Score only the first N scored items.")
@click.option(
    "--repeats",
    type=click.IntRange(1),
    default=None,
    help="Responses per item (default: the lane's). Repeat r sends the lane's seed + r (recorded in each "
    "record's request), so sampled repeats are distinct draws, each reproducible.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder holding gsm8k/test.jsonl. Default: $EVALPIPE_DATA_DIR, then ../shared/data, then `datasets`; "
    "with --resume the folder the run used (its manifest's dataset path).",
)
@click.option(
    "--allow-data-drift",
    is_flag=True,
    help="Run even when the data or prompt hashes differ from "
    "evalpipe/lanes/pins/<lane>.json (recorded in manifest and summary).",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    default=None,
    help="Continue RUN_DIR: items with a non-error record are skipped, error records are retried "
    "(the old ones move to superseded.jsonl), the rest is appended. Everything else (lane, protocol, model, "
    "endpoint, data folder) comes from its manifest unless a flag overrides it.",
)
@click.option(
    "--no-token-ids",
    is_flag=True,
    help="Do not ask for output token ids (return_token_ids: true); use with servers that reject unknown fields.",
)
@click.option("--logprobs", type=click.IntRange(0, 20), default=None, help="Request logprobs (top N) and record them.")
@click.option(
    "--max-retries",
    type=click.IntRange(0, 20),
    default=DEFAULTS["max_retries"],
    show_default=True,
    help="Retries for transport errors, timeouts, 5xx and malformed bodies (never 4xx).",
)
@click.option(
    "--retry-backoff",
    type=click.FloatRange(0.0),
    default=DEFAULTS["retry_backoff_s"],
    show_default=True,
    help="First retry delay in seconds; doubles per retry, capped at 30 s.",
)
@click.option(
    "--grader-timeout",
    type=click.FloatRange(0.001),
    default=DEFAULTS["grader_timeout_s"],
    show_default=True,
    help="Hard per-answer timeout of the AIME grader process; a miss is recorded as grader_timeout.",
)
@click.option(
    "--grader-workers",
    type=click.IntRange(1, 64),
    default=DEFAULTS["grader_workers"],
    show_default=True,
    help="Grader processes for AIME lanes.",
)
@click.option(
    "--fsync",
    is_flag=True,
    help="fsync responses.jsonl after every record (survives power loss; slower). "
    "Without it every record is still flushed, which survives a killed process.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--save-accept-baseline",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the run's per-position acceptance and mean accept lengths (summary.json's "
    "`acceptance`) to FILE, for `evalpipe compare --accept-baseline FILE`. Needs speculation statistics.",
)
def command(**opts):
    from evalpipe.harness.lane_run import LaneRun, RunError

    cfg = resume_config(opts) if opts["resume_dir"] is not None else new_config(opts)
    try:
        outcome = LaneRun(cfg).execute()
    except RunError as exc:
        raise click.ClickException(str(exc)) from None
    print_summary(outcome.summary, outcome.run_dir)
    note_short_lane(cfg, outcome.summary, opts["num_examples"], opts["resume_dir"])
    if opts["save_accept_baseline"] is not None:
        save_baseline(opts["save_accept_baseline"], outcome)
    if outcome.exit_code:
        click.echo(f"evalpipe run: {outcome.message}", err=True)
        sys.exit(outcome.exit_code)


def transport_options(opts: dict) -> dict:
    """The settings of how requests go out, which a resumed run may change."""
    from evalpipe.redact import redact_argv

    return dict(
        api_key=opts["api_key"],
        out_dir=opts["out_dir"],
        timeout_s=opts["timeout_s"],
        max_retries=opts["max_retries"],
        retry_backoff_s=opts["retry_backoff"],
        grader_workers=opts["grader_workers"],
        grader_timeout_s=opts["grader_timeout"],
        fsync=opts["fsync"],
        progress=not opts["no_progress"],
        command_line=redact_argv(sys.argv, [opts["api_key"] or ""]),
        base_url=opts["base_url"],
        model=opts["model"],
        data_dir=opts["data_dir"],
        allow_data_drift=opts["allow_data_drift"],
        token_ids=not opts["no_token_ids"],
        logprobs=opts["logprobs"],
    )


def option_value(opts: dict, name: str):
    return opts["lane_concurrency" if name == "concurrency" else name]


def resume_config(opts: dict) -> RunConfig:
    """The config of the run folder given to --resume; a protocol flag beside it is a usage error."""
    from evalpipe.harness.prepare import NotResumable, ResumeConflict

    given = [f"--{name.replace('_', '-')}" for name in PROTOCOL_OPTIONS if option_value(opts, name) is not None]
    if given:
        raise click.UsageError(f"--resume keeps the run's own protocol; drop {', '.join(given)}")
    try:
        return RunConfig.from_manifest(opts["resume_dir"], lane_name=opts["lane"], **transport_options(opts))
    except ResumeConflict as exc:
        raise click.UsageError(str(exc)) from None
    except NotResumable as exc:
        raise BadInput(str(exc)) from None


def new_config(opts: dict) -> RunConfig:
    if opts["lane"] is None:
        raise click.UsageError("give a LANE (see `evalpipe lanes`) or --resume RUN_DIR")
    seed, sample_seeds = opts["seed"], opts["sample_seeds"]
    if sample_seeds is not None and seed is not None:
        raise click.UsageError("--sample-seeds sets every request's seed; drop --seed")
    overrides = {name: opts[name] for name in LANE_OVERRIDES if opts[name] is not None}
    if seed is not None:
        overrides["seed"] = None if seed == "none" else seed
    transport = transport_options(opts)
    transport["base_url"] = transport["base_url"] or DEFAULT_BASE_URL
    return RunConfig(
        lane=get_lane(opts["lane"]),
        arm=opts["arm"],
        concurrency=opts["lane_concurrency"],
        overrides=overrides,
        num_examples=opts["num_examples"],
        repeats=opts["repeats"],
        sample_seeds=sample_seeds,
        **transport,
    )


def note_short_lane(cfg: RunConfig, summary: dict, num_examples, resume_dir) -> None:
    """Say so when --num-examples asked for more items than the lane has."""
    n_reps = cfg.repeats or cfg.lane.repeats
    if num_examples is not None and resume_dir is None and 0 < summary.get("n_planned", 0) < num_examples * n_reps:
        click.echo(
            f"note: --num-examples {num_examples} is more than lane {cfg.lane.name} has; it ran all "
            f"{summary['n_planned'] // n_reps} scored items",
            err=True,
        )


def save_baseline(path: Path, outcome) -> None:
    from evalpipe.harness.acceptance import write_baseline

    try:
        write_baseline(path, outcome.summary.get("acceptance"), outcome.server_info)
    except (ValueError, OSError) as exc:
        raise click.ClickException(f"cannot save the acceptance baseline: {exc}") from None
    click.echo(f"wrote acceptance baseline {path}")


def print_summary(summary: dict, run_dir: Path) -> None:
    """A compact table on stdout, then the run folder."""
    from rich.markup import escape
    from rich.table import Table

    from evalpipe.console import make_console

    def pct(x):
        return "-" if x is None else f"{100 * x:.2f}%"

    accept = summary.get("spec_accept_length_mean")

    # escaped: "[spec_on]" would otherwise be read as rich markup and vanish from the title
    t = Table(title=escape(f"{summary['lane']} [{summary.get('arm')}]  {summary.get('model')}"), show_header=True)
    for col in (
        "accuracy",
        "correct",
        "planned",
        "records",
        "errors",
        "truncated",
        "invalid" if "n_invalid" in summary else "no answer",
        "accept len",
        "partial",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        pct(summary.get("accuracy")),
        str(summary["n_correct"]),
        str(summary["n_planned"]),
        str(summary["n_records"]),
        str(summary["n_errors"]),
        str(summary["n_truncated"]),
        str(summary.get("n_invalid", summary.get("n_no_answer"))),
        "-" if accept is None else f"{accept:.2f}",
        str(summary.get("partial")),
    )
    console = make_console()
    console.print(t)
    extra = [f"{k}={pct(summary[k])}" for k in summary if k.startswith(("pass@", "majority@")) and k[-1].isdigit()]
    if "no_answer" in summary:
        extra.append(f"no_answer={pct(summary['no_answer'])}")
    if extra:
        console.print("secondary: " + "  ".join(extra))
    if summary.get("by_group"):
        console.print(
            "by group: "
            + "  ".join(
                f"{g} {pct(v['accuracy'])} ({v['n_correct']}/{v['n_planned']})" for g, v in summary["by_group"].items()
            )
        )
    if summary.get("manifest_changed"):
        console.print(f"[bold red]manifest changed during the run:[/] {summary.get('manifest_changes')}")
    if summary.get("data_drift"):
        console.print("[bold yellow]data drift allowed: hashes differ from the pins[/]")
    if summary.get("spec_lossy") or summary.get("server_lossy_acceptance"):
        from rich.markup import escape

        console.print(
            "[bold yellow]LOSSY speculative acceptance[/] "
            f"(server: {escape(str(summary.get('server_lossy_acceptance')))}): "
            f"{summary.get('n_records_lossy', 0)} of {summary['n_records']} responses were accepted by it; "
            "this accuracy measures the lossy rule"
        )
    rps = summary.get("requests_per_s")
    wall = summary.get("wall_s")
    console.print(f"wall {wall:.2f}s, {rps:.1f} req/s" if wall and rps else "")
    console.print(f"run folder: {run_dir}")
