"""`evalpipe serve --engine native|sglang|vllm ...` through a launcher: the flags, dry run, and the serve loop.

The same click command parses the server arguments of `evalpipe ab --a "..." --b "..."`, so an arm is written
exactly as a user would start that server by hand.
"""

from __future__ import annotations

import json
import shlex
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

import click
from click.core import ParameterSource

from evalpipe.launchers import ENGINES, LaunchConfigError, LaunchOptions, ServerStartError, make_launcher
from evalpipe.launchers.env import parse_assignments
from evalpipe.launchers.receipts import build_receipt, effective_problems, server_report, write_receipt

SPECULATION_PROFILES = ("off", "block", "dspark", "eagle", "eagle3", "nextn", "ngram")

HELP = """Start a server through a launcher: the native engine (`evalpipe serve`), SGLang or vLLM.

\b
Speculation profiles (--speculative):
  native: off | block (--block-size, --drafter, as `evalpipe serve`)
  sglang: off | dspark (--draft-model, --block-size) | eagle | eagle3 | nextn
          (--spec-steps, --spec-topk, --spec-draft-tokens: all three or none);
          acceptance thresholds are passed as 1.0, lossy passthrough values are refused
  vllm:   the same profiles, written as --speculative-config JSON, plus ngram
          (prompt lookup: --spec-steps draft tokens, --ngram-min/--ngram-max window)

SGLang and vLLM start as `PYTHON -m sglang.launch_server` / `PYTHON -m vllm.entrypoints.openai.api_server`,
PYTHON being --engine-python (default: this interpreter if it imports the engine, else the one behind the
engine's console script on PATH). The receipt records that interpreter's installed packages.

LOSSY acceptance, on purpose only (to prove an evaluation catches a lossy speculator):
--spec-accept-topk K (native), --spec-accept-threshold-single/-acc P (native, sglang).
Recorded as lossy_acceptance in the dry run and the receipt; never the default.

The child environment drops every inherited SGLANG_* / VLLM_* variable unless named with --keep-env;
simulated acceptance is set only by --simulate-acc-len (performance runs, never scored).
Arguments evalpipe does not know (e.g. --mem-fraction-static 0.8, --nnodes 2 --node-rank 0
--dist-init-addr HOST:PORT) are passed to the engine unchanged; put them after `--` to be explicit.

--dry-run prints the command and environment and starts nothing (where SGLang or vLLM is not installed, it is
the only way to exercise those engines). vLLM's CPU build serves on a machine without GPUs: see README.
Each real launch writes a receipt JSON (argv, redacted environment, engine version, the server's own
settings report, /v1/models, GPUs, start/ready/stop times).
"""


def _pos_int(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter("must be >= 1")
    return value


def launch_params(func):
    """The flags shared by `evalpipe serve --engine ...` and the arms of `evalpipe ab`."""
    options = [
        click.option("--engine", type=click.Choice(ENGINES), default="native", show_default=True, help="Which server to start."),
        click.option("--model", "--model-path", "model", help="Model path or id (native: default tiny model; sglang/vllm: required)."),
        click.option("--tokenizer", "--tokenizer-path", "tokenizer", help="Tokenizer path, when it differs from the model."),
        click.option("--host", default="127.0.0.1", show_default=True, help="Address the server binds."),
        click.option("--port", type=int, default=30000, show_default=True, help="Port the server binds (`ab` picks a free one unless given)."),
        click.option("--tp", "--tp-size", "tp", type=int, callback=_pos_int, help="Tensor-parallel size (sglang --tp-size, vllm --tensor-parallel-size)."),
        click.option("--ep", "--ep-size", "ep", type=int, callback=_pos_int, help="Expert-parallel size (sglang --ep-size; vllm: must equal TP x DP, enables expert parallel)."),
        click.option("--dp", "--dp-size", "dp", type=int, callback=_pos_int, help="Data-parallel size (sglang --dp-size, vllm --data-parallel-size)."),
        click.option("--dtype", help="Weights/activation dtype passed to the engine (native: float32|bfloat16)."),
        click.option("--device", help="Native engine device (cpu|cuda)."),
        click.option("--max-batch", type=int, callback=_pos_int, help="Native engine: most requests decoded together."),
        click.option("--api-key", help="Key the server requires; redacted in every receipt and printout."),
        click.option("--speculative", type=click.Choice(SPECULATION_PROFILES), help="Speculation profile (see above); default: the engine's default, off."),
        click.option("--block-size", type=int, callback=_pos_int, help="native block / sglang dspark block size / vllm dspark draft tokens."),
        click.option("--drafter", help="Native engine drafter (layerskip:N, model:PATH, ngram, self)."),
        click.option("--draft-model", help="sglang/vllm draft model path (--speculative-draft-model-path / speculative-config model)."),
        click.option("--spec-steps", type=int, callback=_pos_int, help="eagle/eagle3/nextn: draft depth (--speculative-num-steps); vllm ngram: draft tokens per step."),
        click.option("--spec-topk", type=int, callback=_pos_int, help="eagle/eagle3/nextn: branching (--speculative-eagle-topk)."),
        click.option("--spec-draft-tokens", type=int, callback=_pos_int, help="eagle/eagle3/nextn: tokens verified per step (--speculative-num-draft-tokens)."),
        click.option("--deterministic", is_flag=True, help="sglang --enable-deterministic-inference; vllm VLLM_BATCH_INVARIANT=1."),
        click.option("--simulate-acc-len", type=float, help="PERFORMANCE ONLY: commit X tokens per step unchecked (SGLANG_SIMULATE_ACC_LEN, vLLM synthetic sampler, native flag). Never score such a run."),
        click.option("--spec-accept-topk", type=int, help="LOSSY, native only: accept a draft among the target's top K (K >= 2). Evaluation only; recorded."),
        click.option("--spec-accept-threshold-single", type=float, help="LOSSY below 1.0 (native, sglang --speculative-accept-threshold-single): accept a sampled draft whose target probability is >= P. Evaluation only; recorded."),
        click.option("--spec-accept-threshold-acc", type=float, help="LOSSY below 1.0 (native, sglang --speculative-accept-threshold-acc): accept a sampled draft with probability min(1, p / P). Evaluation only; recorded."),
        click.option("--keep-env", multiple=True, help="Keep an inherited SGLANG_*/VLLM_* variable (name or glob; repeatable)."),
        click.option("--set-env", multiple=True, help="Set NAME=VALUE in the server environment on purpose (repeatable), e.g. SGLANG_ENABLE_SPEC_V2=True."),
        click.option("--engine-python", type=click.Path(dir_okay=False), help="sglang/vllm: the python of the environment where the engine lives, e.g. .venv-vllm/bin/python [default: this one if it imports the engine, else the one behind `sglang`/`vllm` on PATH]."),
        click.option("--engine-command", help="Replace the program prefix, e.g. 'srun -N2 ./sglang_node.sh' (shell-split); not with --engine-python."),
        click.option("--ngram-min", type=int, callback=_pos_int, help="vllm ngram: shortest prompt n-gram to match (prompt_lookup_min) [default: vLLM's]."),
        click.option("--ngram-max", type=int, callback=_pos_int, help="vllm ngram: longest prompt n-gram to match (prompt_lookup_max) [default: vLLM's]."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def options_from_params(params: dict) -> LaunchOptions:
    """LaunchOptions from parsed click parameters; raises LaunchConfigError on malformed --set-env."""
    return LaunchOptions(
        engine=params["engine"],
        model=params["model"],
        tokenizer=params["tokenizer"],
        host=params["host"],
        port=params["port"],
        tp=params["tp"],
        ep=params["ep"],
        dp=params["dp"],
        dtype=params["dtype"],
        device=params["device"],
        max_batch=params["max_batch"],
        api_key=params["api_key"],
        speculative=params["speculative"],
        block_size=params["block_size"],
        drafter=params["drafter"],
        draft_model=params["draft_model"],
        spec_steps=params["spec_steps"],
        spec_topk=params["spec_topk"],
        spec_draft_tokens=params["spec_draft_tokens"],
        deterministic=params["deterministic"],
        simulate_acc_len=params["simulate_acc_len"],
        spec_accept_topk=params["spec_accept_topk"],
        spec_accept_threshold_single=params["spec_accept_threshold_single"],
        spec_accept_threshold_acc=params["spec_accept_threshold_acc"],
        keep_env=tuple(params["keep_env"]),
        set_env=parse_assignments(params["set_env"]),
        engine_command=tuple(shlex.split(params["engine_command"])) if params["engine_command"] else None,
        engine_python=params["engine_python"],
        ngram_min=params["ngram_min"],
        ngram_max=params["ngram_max"],
        extra_args=tuple(params["extra_args"]),
    )


@click.command(
    "serve",
    help=HELP,
    context_settings={"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]},
)
@launch_params
@click.option("--dry-run", is_flag=True, help="Print the command and environment; start nothing.")
@click.option("--json", "as_json", is_flag=True, help="With --dry-run: print it as JSON.")
@click.option("--ready-timeout", type=float, default=900.0, show_default=True, help="Seconds to wait for the health check.")
@click.option("--receipt", type=click.Path(dir_okay=False), help="Receipt JSON path [default: results/receipts/ENGINE-TIME.json].")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Server log path [default: next to the receipt, .log].")
@click.argument("extra_args", nargs=-1, type=click.UNPROCESSED)
def command(dry_run, as_json, ready_timeout, receipt, log_file, **params):
    if "--dry-run" in params["extra_args"]:
        raise click.UsageError("--dry-run after `--` would go to the engine and start it; put it before `--`")
    launcher = _launcher_or_usage_error(params)
    if dry_run:
        plan = launcher.dry_run()
        if as_json:
            click.echo(json.dumps(plan, indent=2))
        else:
            click.echo(f"# {launcher.engine} (dry run: nothing started)")
            if plan["env_removed"]:
                click.echo(f"# cleared inherited: {' '.join(plan['env_removed'])}")
            if plan["env_kept"]:
                click.echo(f"# kept on request: {' '.join(plan['env_kept'])}")
            if plan["performance_only"]:
                click.echo("# PERFORMANCE ONLY: simulated acceptance, never score this server")
            if plan["lossy_acceptance"]:
                click.echo(f"# LOSSY ACCEPTANCE {json.dumps(plan['lossy_acceptance'])}: accepts drafts the target "
                           "did not choose; for measuring that cost only")
            click.echo(plan["command"])
            click.echo(f"# ready when GET {plan['health_url']} returns 200")
        return
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    receipt_path = Path(receipt or f"results/receipts/{launcher.engine}-{stamp}.json")
    log_path = Path(log_file) if log_file else receipt_path.with_suffix(".log")
    serve_until_interrupted(launcher, receipt_path, log_path, ready_timeout)


def _launcher_or_usage_error(params: dict):
    try:
        return make_launcher(options_from_params(params))
    except LaunchConfigError as exc:
        raise click.UsageError(str(exc)) from None


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def boot(launcher, receipt_path: Path, log_path: Path, ready_timeout: float) -> dict:
    """Start, wait until ready, check the effective settings, write the receipt. Leaves nothing running on failure."""
    try:
        launcher.start(log_path)
        launcher.wait_ready(ready_timeout)
        report = server_report(launcher)
    except BaseException:
        launcher.stop()
        if launcher.process is not None:
            write_receipt(receipt_path, build_receipt(launcher))
        raise
    receipt = build_receipt(launcher, report)
    write_receipt(receipt_path, receipt)
    problems = effective_problems(launcher, report.get("server_info"))
    if problems:
        launcher.stop()
        write_receipt(receipt_path, {**receipt, **launcher.describe()})
        raise ServerStartError("refusing this server for accuracy runs:\n  " + "\n  ".join(problems))
    return receipt


def finish(launcher, receipt_path: Path, receipt: dict) -> dict:
    """Stop the server and record the stop in its receipt."""
    launcher.stop()
    receipt = {**receipt, **launcher.describe()}
    write_receipt(receipt_path, receipt)
    return receipt


def serve_until_interrupted(launcher, receipt_path: Path, log_path: Path, ready_timeout: float) -> None:
    previous = signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    receipt = None
    try:
        click.echo(f"starting {launcher.engine}: {launcher.shell_command()}", err=True)
        click.echo(f"log: {log_path}", err=True)
        try:
            receipt = boot(launcher, receipt_path, log_path, ready_timeout)
        except ServerStartError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"ready: {launcher.base_url}/v1  (receipt: {receipt_path})")
        code = launcher.process.wait()
        tail = launcher.log_tail()
        receipt = finish(launcher, receipt_path, receipt)
        raise click.ClickException(f"{launcher.engine} server exited with code {code}.\n--- log tail ---\n{tail}")
    except KeyboardInterrupt:
        click.echo("stopping server ...", err=True)
        if receipt is not None:
            finish(launcher, receipt_path, receipt)
        launcher.stop()
        sys.exit(130)
    finally:
        launcher.stop()
        signal.signal(signal.SIGTERM, previous)


def parse_serve_args(argv: list[str]) -> tuple[LaunchOptions, set[str]]:
    """Parse one arm's server arguments as `evalpipe serve --engine ...` would.

    Returns the options and the names of the flags given on the command line (for declaring A/B differences).
    """
    ctx = command.make_context("serve", list(argv), resilient_parsing=False)
    params = dict(ctx.params)
    for name in ("dry_run", "as_json", "ready_timeout", "receipt", "log_file"):
        if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE:
            raise click.UsageError(f"--{name.replace('_', '-')} is set by `evalpipe ab` itself, not in an arm")
        params.pop(name)
    given = {name for name in params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    try:
        return options_from_params(params), given
    except LaunchConfigError as exc:
        raise click.UsageError(str(exc)) from None
