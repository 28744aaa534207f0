"""`evalpipe repeat`: how many distinct completions does one prompt get over N identical greedy requests?"""

from __future__ import annotations

import asyncio
from pathlib import Path

import click

from evalpipe.harness.client import DEFAULT_BASE_URL

CONDITION_HELP = (
    "serial, burst, logprobs, prefix_fresh, prefix_reused; batch_shape (= batch_1,batch_8,batch_64: "
    "alone and among 7 or 63 other prompts, with logprobs; not in the default); seeded_batch_shape (= "
    "seeded_batch_1,seeded_batch_8,seeded_batch_64: the same at temperature 1 with every request of a fixture "
    "seeded 46, so a server whose sampled tokens depend only on prompt and seed gives one completion; controls "
    "not graded; not in the default)"
)


@click.command(name="repeat")
@click.option(
    "--base-url",
    default=DEFAULT_BASE_URL,
    show_default=True,
    help="OpenAI-compatible endpoint including /v1 (the default is where `evalpipe serve` listens).",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Identical requests per fixture and condition (N). N = 1 still compares the conditions with each other "
    "(alone against batched, for one); run-to-run variation within a condition needs N >= 2.",
)
@click.option("--model", default=None, help="Model id [default: the first id the server lists].")
@click.option("--api-key", default=None, envvar="EVALPIPE_API_KEY", help="Bearer key (env EVALPIPE_API_KEY).")
@click.option(
    "--fixtures",
    "fixture_ids",
    default=None,
    metavar="ID[,ID...]",
    help="Subset of fixtures (arithmetic, exact_copy, regex_date, open_short, open_long_context) [default: all].",
)
@click.option(
    "--conditions",
    default=None,
    metavar="C[,C...]",
    help=f"Subset of conditions ({CONDITION_HELP}) [default: all; prefix_* only where the server "
    "can drop its prefix cache (/flush_cache, or vLLM's /reset_prefix_cache with "
    "VLLM_SERVER_DEV_MODE=1) and reports cached tokens].",
)
@click.option(
    "--max-tokens",
    "open_max_tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="max_tokens of the open prompts (controls use their own short limits).",
)
@click.option(
    "--long-context-chars",
    type=click.IntRange(min=0),
    default=6000,
    show_default=True,
    help="Characters of padding before the long-context copy of the open prompt.",
)
@click.option(
    "--no-token-ids",
    is_flag=True,
    help="Do not ask for return_token_ids (for servers that reject it); identity is then judged on text.",
)
@click.option("--arm", default="repeat", show_default=True, help="Label recorded on every response.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="results",
    show_default=True,
    help="Parent folder; the run lands in <out>/repeat/<run_id>/.",
)
@click.option("--timeout", "timeout_s", type=float, default=300.0, show_default=True, help="Per-request timeout (s).")
@click.option(
    "--fail-on-control",
    is_flag=True,
    help="Exit 4 when any response to a control (arithmetic, exact copy) is not exactly right, naming the fixture "
    "and condition (a CI gate: a broken server, or a model that does not answer the controls).",
)
def command(
    base_url,
    repeats,
    model,
    api_key,
    fixture_ids,
    conditions,
    open_max_tokens,
    long_context_chars,
    no_token_ids,
    arm,
    out_dir,
    timeout_s,
    fail_on_control,
):
    """Send each fixture N times at temperature 0 under several conditions and count distinct completions.

    Reports per fixture and condition: distinct completions out of N, the modal completion's share, the first
    divergence position from the mode (token ids where returned, else characters) and the logprob gap there,
    and whether the controls were correct. Writes responses.jsonl (run-record form), repeat.json, manifest.json.
    Exit codes: 0 done; 1 a refused server; 2 bad input; 4 with --fail-on-control, a control response was wrong;
    130 interrupted.
    """
    from evalpipe.harness.records import REPEAT_FILE, RESPONSES_FILE
    from evalpipe.harness.repeat import RepeatConfig
    from evalpipe.harness.server_facts import determinism_note, deterministic_label

    cfg = RepeatConfig(
        base_url=base_url.rstrip("/"),
        fixtures=_selected_fixtures(fixture_ids, long_context_chars, open_max_tokens),
        repeats=repeats,
        conditions=_selected_conditions(conditions),
        model=model,
        api_key=api_key,
        token_ids=not no_token_ids,
        timeout_s=timeout_s,
        arm=arm,
        out_dir=Path(out_dir),
    )
    result, records = _run_with_progress(cfg)
    _print_table(result, repeats)
    deterministic = result["server"].get("deterministic")
    click.echo(f"server deterministic: {deterministic_label(deterministic)}")
    click.echo(determinism_note([deterministic]))
    for line in error_lines(records):
        click.echo(line, err=True)
    for c, why in result["config"]["conditions_skipped"].items():
        click.echo(f"skipped condition {c}: {why}")
    run_dir = Path(out_dir) / "repeat" / result["run_id"]
    click.echo(f"wrote {run_dir / REPEAT_FILE} and {run_dir / RESPONSES_FILE}")
    wrong = wrong_controls(result)
    for line in wrong:
        click.echo(f"control wrong: {line}", err=True)
    if fail_on_control and wrong:
        raise SystemExit(4)


def _selected_fixtures(fixture_ids, long_context_chars: int, open_max_tokens: int) -> list:
    """The fixtures `--fixtures` names (all without it); an unknown id is a usage error."""
    from evalpipe.lanes.repeat_fixtures import fixtures

    all_fx = fixtures(long_context_chars=long_context_chars, open_max_tokens=open_max_tokens)
    if fixture_ids:
        wanted = [x.strip() for x in fixture_ids.split(",") if x.strip()]
        unknown = sorted(set(wanted) - {f.id for f in all_fx})
        if unknown:
            raise click.UsageError(f"unknown fixture(s) {unknown}; known: {[f.id for f in all_fx]}")
        all_fx = [f for f in all_fx if f.id in wanted]
    return all_fx


def _selected_conditions(conditions) -> tuple:
    """The conditions `--conditions` names, shape names expanded to their sizes (all without it); an unknown
    condition, or none, is a usage error."""
    from evalpipe.harness.repeat import BATCH_SHAPE, BATCH_SIZES, CONDITIONS, SEEDED_BATCH_SHAPE, SEEDED_BATCH_SIZES

    conds = tuple(CONDITIONS)
    if conditions:
        conds = tuple(x.strip() for x in conditions.split(",") if x.strip())
        shapes = {BATCH_SHAPE: BATCH_SIZES, SEEDED_BATCH_SHAPE: SEEDED_BATCH_SIZES}
        conds = tuple(dict.fromkeys(s for c in conds for s in shapes.get(c, (c,))))
        known = [*CONDITIONS, BATCH_SHAPE, *BATCH_SIZES, SEEDED_BATCH_SHAPE, *SEEDED_BATCH_SIZES]
        bad = sorted(set(conds) - set(known))
        if bad or not conds:
            raise click.UsageError(f"unknown condition(s) {bad or '(none given)'}; known: {known}")
    return conds


def _run_with_progress(cfg) -> tuple[dict, list]:
    """Run the repeat with a progress bar: (result, records). Ctrl-C writes a partial repeat.json and exits 130; a
    refused server is a message, not a traceback."""
    from tqdm import tqdm

    from evalpipe.harness.client import EndpointError
    from evalpipe.harness.repeat import RepeatError, RepeatRun, planned_requests

    bar = tqdm(total=planned_requests(cfg), desc="repeat", unit="req")
    runner = RepeatRun(cfg, progress=bar.update)
    try:
        result = asyncio.run(runner.run())
    except KeyboardInterrupt:
        bar.close()
        if runner.run_dir is not None and runner.records:  # every landed response is already in responses.jsonl
            runner.write_result(partial=True)
            click.echo(f"interrupted: partial repeat.json written in {runner.run_dir}", err=True)
        raise SystemExit(130)
    except (RepeatError, EndpointError) as exc:  # a wrong model, an unreachable server: a message, no traceback
        raise click.ClickException(str(exc)) from exc
    finally:
        bar.close()
    return result, runner.records


def _print_table(result: dict, repeats: int) -> None:
    """One row per fixture and condition: distinct completions, modal share, first divergence, control."""
    from rich.markup import escape
    from rich.table import Table

    from evalpipe.console import make_console

    seeded = result["config"].get("seeded")
    temps = "temperature 0" + (
        f"; seeded_*: temperature {seeded['temperature']:g}, seed {seeded['seed']}" if seeded else ""
    )
    t = Table(title=f"evalpipe repeat — {result['config']['model']}, N = {repeats}, {temps}")
    for col in ("fixture", "condition", "distinct/N", "modal share", "first divergence", "logprob gap", "control"):
        t.add_column(col)
    for fx, conds_ in result["groups"].items():
        for c, g in conds_.items():
            control = ""
            if "control_correct_share" in g:
                control = f"{'right' if g['mode_correct'] else 'WRONG'} ({g['control_correct_share']:.0%})"
            gap = g.get("logprob_gap_at_first_divergence")
            t.add_row(
                fx,
                c,
                f"{g['distinct']}/{g['n']}" + (f" ({g['n_errors']} err)" if g["n_errors"] else ""),
                f"{g['modal_share']:.0%}" if "modal_share" in g else "n/a",
                str(g.get("first_divergence_from_mode") if g.get("first_divergence_from_mode") is not None else "-"),
                f"{gap:.3g}" if gap is not None else "-",
                escape(control),
            )
    make_console().print(t)


def wrong_controls(result: dict) -> list[str]:
    """`fixture/condition: k of n right` for each control group with a response that is not exactly right."""
    lines = []
    for fx, conds in result["groups"].items():
        for cond, g in conds.items():
            share = g.get("control_correct_share")
            if share is not None and (share < 1 or g["n_errors"]):
                right = round(share * (g["n"] - g["n_errors"]))
                lines.append(f"{fx}/{cond}: {right} of {g['n']} right (expected {g['expected']!r})")
    return lines


def error_lines(records: list[dict]) -> list[str]:
    """One line per fixture and distinct error, so an "(N err)" cell in the table has a visible reason."""
    seen: dict[tuple[str, str], list[str]] = {}
    for r in records:
        err = r.get("error")
        if err:
            key = (r.get("fixture") or str(r.get("question_id")), str(err.get("message") or err.get("type")))
            conds = seen.setdefault(key, [])
            if r.get("condition") not in conds:
                conds.append(r.get("condition"))
    return [f"error in {fx} ({', '.join(map(str, conds))}): {msg[:400]}" for (fx, msg), conds in seen.items()]
