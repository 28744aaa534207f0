"""`evalpipe lanes`: list the lanes and their protocol parameters (optionally verify their pinned hashes)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command(name="lanes")
@click.option("--json", "as_json", is_flag=True, help="Print the lane specs as JSON instead of a table.")
@click.option(
    "--check-pins",
    is_flag=True,
    help="Load each lane's data, recompute its dataset / id-list / template / "
    "prompt-stream hashes and compare them with evalpipe/lanes/pins/<lane>.json; exit 1 on any difference.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder holding gsm8k/test.jsonl (for --check-pins). Default: $EVALPIPE_DATA_DIR, then ../shared/data.",
)
def command(as_json, check_pins, data_dir):
    """List the evaluation lanes: endpoint, sampling parameters, repeats, concurrency, grader, headline."""
    from evalpipe.lanes import all_lanes, computed_pins, load_pins, pin_differences
    from evalpipe.lanes.data import DataError

    lanes = all_lanes()
    if as_json and not check_pins:
        click.echo(json.dumps([lane.describe() | {"pins": load_pins(lane.name)} for lane in lanes], indent=2))
        return
    if not as_json:
        from rich.table import Table

        from evalpipe.console import make_console

        t = Table(title="evalpipe lanes", show_lines=True)
        for col in ("lane", "api", "params", "repeats", "concurrency", "grader", "headline"):
            t.add_column(col, overflow="fold")
        for lane in lanes:
            params = ", ".join(f"{k}={v!r}" for k, v in lane.params.items())
            t.add_row(lane.name, lane.api, params, str(lane.repeats), str(lane.concurrency), lane.grader, lane.headline)
        make_console().print(t)
    if check_pins:
        bad = False
        results = []
        for lane in lanes:
            try:
                data = lane.load(data_dir, allow_data_drift=True)
            except DataError as exc:
                raise click.ClickException(str(exc)) from None
            diffs = pin_differences(lane, data)
            bad |= bool(diffs)
            results.append({"lane": lane.name, "computed": computed_pins(lane, data), "differences": diffs})
            if not as_json:
                click.echo(f"{lane.name}: " + ("pins match" if not diffs else "DIFFERS\n  " + "\n  ".join(diffs)))
        if as_json:
            click.echo(json.dumps(results, indent=2))
        if bad:
            raise SystemExit(1)
