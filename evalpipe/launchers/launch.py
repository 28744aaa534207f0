"""One launch of a server through its launcher: the dry run, or boot (start, wait until ready, receipt), serve
until interrupted, and stop. `evalpipe serve` calls `run`; `evalpipe ab` boots and stops each arm with
`boot` / `finish`.
"""

from __future__ import annotations

import json
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path

import click

from evalpipe.launchers import LaunchConfigError, LaunchOptions, ServerStartError, make_launcher
from evalpipe.launchers.receipts import build_receipt, effective_problems, server_report, write_receipt


def run(
    options: LaunchOptions,
    *,
    dry_run: bool,
    as_json: bool,
    ready_timeout: float,
    receipt: str | None,
    log_file: str | None,
) -> None:
    """Print the dry run, or serve through the launcher until interrupted; refusals are usage errors."""
    if "--dry-run" in options.extra_args:
        raise click.UsageError("--dry-run after `--` would go to the engine and start it; put it before `--`")
    try:
        launcher = make_launcher(options)
    except LaunchConfigError as exc:
        raise click.UsageError(str(exc)) from None
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
                click.echo(
                    f"# LOSSY ACCEPTANCE {json.dumps(plan['lossy_acceptance'])}: accepts drafts the target "
                    "did not choose; for measuring that cost only"
                )
            click.echo(plan["command"])
            click.echo(f"# ready when GET {plan['health_url']} returns 200")
        return
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    receipt_path = Path(receipt or f"results/receipts/{launcher.engine}-{stamp}.json")
    log_path = Path(log_file) if log_file else receipt_path.with_suffix(".log")
    serve_until_interrupted(launcher, receipt_path, log_path, ready_timeout)


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
