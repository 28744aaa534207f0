"""`evalpipe ab`: a fair A/B in one command -- fresh boots, nothing but the declared difference, one report.

For each arm in `--order` (default ABBA: A1 B1 B2 A2) a fresh server is booted on a free port through the
launchers; its receipt is checked against the first receipt of the same side (must match entirely) and of the
other side (may differ only in the flags that differ between --a and --b); the lanes run; the server stops.
Then every lane is compared A_i vs B_i, and A1 vs A_k, B1 vs B_k to show boot-to-boot variation beside the A/B
difference. Everything lands in one folder: arms/<label>/{receipt.json,server.log,runs/}, compare/<lane>/<pair>/,
ab.json and report.html.
"""

from __future__ import annotations

import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from evalpipe.ab.arms import TIE_THRESHOLD, declared_flags, merge_args
from evalpipe.compare.gate import FAIL_ON_HELP, parse_fail_on


def _split(text: str, what: str) -> list[str]:
    try:
        return shlex.split(text or "")
    except ValueError as exc:
        raise click.UsageError(f"{what}: {exc}") from None


def _lane_names(lanes: str) -> list[str]:
    """The comma-separated lane names; UsageError when none is given or one is unknown."""
    from evalpipe.lanes import LANE_MODULES

    lane_names = [name.strip() for name in lanes.split(",") if name.strip()]
    unknown = [name for name in lane_names if name not in LANE_MODULES]
    if not lane_names or unknown:
        raise click.UsageError(
            f"unknown lane(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(LANE_MODULES)}"
        )
    return lane_names


def _boot_order(order: str) -> str:
    """--order upper-cased; UsageError unless it is A and B letters with at least one of each."""
    order = order.strip().upper()
    if not order or set(order) - {"A", "B"} or "A" not in order or "B" not in order:
        raise click.UsageError("--order is a string of A and B with at least one of each, e.g. ABBA")
    return order


def _ab_folder(out_dir: Path | None) -> Path:
    """--out (default results/ab/<UTC time>), created; UsageError when it exists and is not empty."""
    out = out_dir or Path("results") / "ab" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    if out.exists() and any(out.iterdir()):
        raise click.UsageError(f"{out} exists and is not empty; an A/B folder holds exactly one A/B")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _parse_arm(side: str, common: list[str], own: list[str]):
    from evalpipe.launchers import LaunchConfigError, make_launcher
    from evalpipe.launchers.flags import parse_serve_args

    try:
        options, given = parse_serve_args(merge_args(common, own))
        make_launcher(options)  # refuse bad settings before anything boots
    except click.UsageError as exc:
        raise click.UsageError(f"arm {side}: {exc.format_message()}") from None
    except click.ClickException as exc:
        raise click.UsageError(f"arm {side}: {exc.format_message()}") from None
    except LaunchConfigError as exc:
        raise click.UsageError(f"arm {side}: {exc}") from None
    return options, given


@click.command("ab", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--lanes", required=True, help="Comma-separated lanes to run on every arm, e.g. gsm8k,aime26.")
@click.option(
    "--a",
    "a_args",
    required=True,
    metavar='"SERVE ARGS"',
    help="Arm A server arguments, exactly as for `evalpipe serve` "
    '(e.g. "--engine sglang --model M --speculative off").',
)
@click.option("--b", "b_args", required=True, metavar='"SERVE ARGS"', help="Arm B server arguments.")
@click.option(
    "--common",
    "common_args",
    default="",
    metavar='"SERVE ARGS"',
    help="Arguments put before both --a and --b (the shared part of the two command lines).",
)
@click.option(
    "--order",
    default="ABBA",
    show_default=True,
    help="Boot order, letters A and B; each letter is a fresh server. Repeats of a side are compared "
    "with each other to show boot-to-boot variation.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="The A/B folder (must not exist or be empty) [default: results/ab/<UTC time>].",
)
@click.option("--num-examples", type=click.IntRange(1), default=None, help="Score only the first N items of each lane.")
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="Override each lane's max_tokens.")
@click.option("--concurrency", type=click.IntRange(1, 4096), default=None, help="Override each lane's concurrency.")
@click.option(
    "--logprobs",
    type=click.IntRange(0, 20),
    default=2,
    show_default=True,
    help="Top logprobs recorded per token, so that an output difference can be judged a numerical tie. "
    "Same for both arms.",
)
@click.option(
    "--no-logprobs", is_flag=True, help="Record no logprobs (differences are then reported without the tie rule)."
)
@click.option(
    "--tie-threshold",
    type=float,
    default=TIE_THRESHOLD,
    show_default=True,
    help="Tie rule: a differing greedy output counts as a numerical tie when the logprob gap between the "
    "two chosen tokens at the first differing position is below this.",
)
@click.option(
    "--margin", type=float, default=1.0, show_default=True, help="Non-inferiority margin in points (passed to compare)."
)
@click.option(
    "--fail-on",
    "fail_on",
    default=None,
    metavar="VERDICTS",
    help=FAIL_ON_HELP + " Only the A vs B pairs are gated, not the boot-to-boot ones.",
)
@click.option(
    "--allow-diff",
    multiple=True,
    metavar="GLOB",
    help="Server-setting keys allowed to differ beyond the declared flags (e.g. 'cuda_graph_max_bs'); repeatable.",
)
@click.option(
    "--ready-timeout", type=float, default=900.0, show_default=True, help="Seconds each boot may take to become ready."
)
@click.option(
    "--preflight",
    is_flag=True,
    help="Only boot one A and one B, check their receipts, stop: catches an unfair setup before hours of lanes.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Data folder for the lanes (else EVALPIPE_DATA_DIR).",
)
def command(
    lanes,
    a_args,
    b_args,
    common_args,
    order,
    out_dir,
    num_examples,
    max_tokens,
    concurrency,
    logprobs,
    no_logprobs,
    tie_threshold,
    margin,
    fail_on,
    allow_diff,
    ready_timeout,
    preflight,
    data_dir,
):
    """Boot arm A and arm B fresh (in --order), run the lanes on each, compare, write one report.

    \b
    Example (native engine, speculation off vs on):
      evalpipe ab --lanes gsm8k --num-examples 30 --max-tokens 32 \\
        --a "--speculative off" --b "--speculative block --block-size 5"
    Arms may use --engine sglang|vllm with their own flags (see `evalpipe serve --engine sglang --help`).
    The run stops, with the differences listed, when a boot's receipt (engine version, GPUs, served model,
    environment, the server's own settings report) differs from its partner's in anything the declared flags
    (those that differ between --a and --b) do not explain.

    \b
    Exit codes: 0 done (whatever the verdicts, unless --fail-on); 1 a boot, lane or comparison failed or a
    receipt was refused; 2 usage error; 4 an A vs B verdict is one of --fail-on; 130 interrupted.
    """
    gate = parse_fail_on(fail_on)
    lane_names = _lane_names(lanes)
    order = _boot_order(order)
    common = _split(common_args, "--common")
    opts_a, given_a = _parse_arm("A", common, _split(a_args, "--a"))
    opts_b, given_b = _parse_arm("B", common, _split(b_args, "--b"))
    declared = declared_flags(opts_a, opts_b)
    out = _ab_folder(out_dir)
    if not declared:
        click.echo("note: --a and --b are identical; this A/B measures boot-to-boot variation only", err=True)

    from evalpipe.ab.run import ABRun
    from evalpipe.redact import redact_argv

    run = ABRun(
        out=out,
        lanes=lane_names,
        options={"A": opts_a, "B": opts_b},
        port_given={"A": "port" in given_a, "B": "port" in given_b},
        args={"A": a_args, "B": b_args, "common": common_args},
        order=order,
        declared=declared,
        allow=list(allow_diff),
        ready_timeout=ready_timeout,
        num_examples=num_examples,
        max_tokens=max_tokens,
        concurrency=concurrency,
        logprobs=None if no_logprobs else logprobs,
        tie_threshold=tie_threshold,
        margin=margin,
        fail_on=gate,
        data_dir=data_dir,
        command_line=redact_argv(["evalpipe", *sys.argv[1:]]),
    )
    code = run.execute(preflight=preflight)
    click.echo(f"A/B folder: {out}")
    if code:
        sys.exit(code)
