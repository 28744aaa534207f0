"""`evalpipe bench`: streamed decode throughput against an OpenAI-compatible endpoint, prefill excluded."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import click

from evalpipe.harness.client import DEFAULT_BASE_URL


@click.command(name="bench")
@click.option(
    "--base-url",
    default=DEFAULT_BASE_URL,
    show_default=True,
    help="OpenAI-compatible endpoint including /v1 (the default is where `evalpipe serve` listens).",
)
@click.option("--model", default=None, help="Model id [default: the first id the server lists].")
@click.option("--api-key", default=None, envvar="EVALPIPE_API_KEY", help="Bearer key (env EVALPIPE_API_KEY).")
@click.option(
    "--input-len",
    type=click.IntRange(min=1),
    default=1024,
    show_default=True,
    help="Prompt length in token ids (fixed random ids from --seed, sent as a token-id prompt). "
    "--input-len + --output-len must fit the server's max_model_len (4096 for `evalpipe serve`).",
)
@click.option(
    "--output-len",
    type=click.IntRange(min=2),
    default=256,
    show_default=True,
    help="Completion tokens per request (ignore_eos keeps every request this long).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=6,
    show_default=True,
    help="Measured rounds; every value is kept, low outliers included.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Warm-up rounds run first and dropped (graphs, compilation, caches).",
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Requests in flight per round (one distinct prompt per slot).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random input ids (recorded).")
@click.option(
    "--token-id-range",
    type=(int, int),
    default=None,
    metavar="LOW HIGH",
    help="Draw input ids from [LOW, HIGH) [default: from the server's vocab_size, else from the ids its "
    "/tokenize gives for a probe text; a server with neither is refused].",
)
@click.option(
    "--no-flush",
    is_flag=True,
    help="Do not reset the prefix cache between rounds (POST /flush_cache, or vLLM's "
    "/reset_prefix_cache with VLLM_SERVER_DEV_MODE=1) even where the server offers it.",
)
@click.option(
    "--client-processes",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes that read each round's streams (at most --concurrency), each with its share of the slots; all "
    "streams of a round start together. More than 1 raises the client's own events-per-second limit on a host "
    "with spare cores; the records are the same.",
)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Per-request timeout (s).")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Folder for bench.json [default: results/bench/<timestamp>].",
)
def command(
    base_url,
    model,
    api_key,
    input_len,
    output_len,
    rounds,
    warmup,
    concurrency,
    seed,
    token_id_range,
    no_flush,
    client_processes,
    timeout_s,
    out_dir,
):
    """Measure streamed decode throughput: (final tokens - first-event tokens) / (t_last - t_first) per request.

    Token counts per streamed event are exact (chunk token_ids or cumulative usage), never chunk counts. The
    server's prefix cache is reset between rounds where it offers /flush_cache or /reset_prefix_cache. Also
    records TTFT, total time, the server's accept length when reported, and run-level speculative counters from
    its /metrics (vLLM, SGLang). Writes bench.json (every event time and count) and prints each metric's median,
    min, max and count.
    """
    from evalpipe.harness.bench import BenchConfig

    if client_processes > concurrency:
        raise click.BadParameter(
            f"{client_processes} processes for {concurrency} streams: at most --concurrency",
            param_hint="--client-processes",
        )
    cfg = BenchConfig(
        base_url=base_url,
        model=model,
        api_key=api_key,
        input_len=input_len,
        output_len=output_len,
        rounds=rounds,
        warmup=warmup,
        concurrency=concurrency,
        seed=seed,
        token_id_range=tuple(token_id_range) if token_id_range else None,
        flush=not no_flush,
        timeout_s=timeout_s,
        client_processes=client_processes,
    )
    out = Path(out_dir) if out_dir else Path("results") / "bench" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    result, path = measure(cfg, out)
    report(result, path, no_flush)


def measure(cfg, out: Path) -> tuple[dict, Path]:
    """Run the bench with a progress bar; (bench.json's content, its path). Ctrl-C keeps the finished rounds."""
    from tqdm import tqdm

    from evalpipe.harness.bench import BenchError, BenchState, run_bench, write_bench

    bar = tqdm(total=cfg.warmup + cfg.rounds, desc="bench rounds", unit="round")

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    state = BenchState(cfg)
    try:
        result = asyncio.run(run_bench(cfg, progress, state))
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        bar.close()
        if state.requests:  # keep every finished round; compare refuses a partial bench unless --force
            click.echo(
                f"interrupted: partial bench written to {write_bench(state.assemble(partial=True), out)}", err=True
            )
        raise SystemExit(130)
    finally:
        bar.close()
    return result, write_bench(result, out)


def report(result: dict, path: Path, no_flush: bool) -> None:
    """The medians table (median, min, max, count per metric), the warnings, where bench.json went; exit 1 when no
    measured request succeeded."""
    from evalpipe.console import make_console

    res = result["results"]
    make_console().print(medians_table(result, path))
    if res["n_errors"]:
        msgs = sorted({str((r.get("error") or {}).get("message"))[:300] for r in result["requests"] if r.get("error")})
        click.echo(
            f"warning: {res['n_errors']} request(s) failed (details in bench.json): " + " | ".join(msgs[:3]), err=True
        )
    if res["n_dropped"]:
        click.echo(f"warning: {res['n_dropped']} request(s) had fewer than 2 content events (no decode rate)", err=True)
    reset = result["server"].get("cache_reset_path")
    click.echo(
        f"prefix cache reset between rounds: {'off (--no-flush)' if no_flush else (reset or 'not offered')}; "
        f"wrote {path}"
    )
    if res["n_kept"] == 0:
        raise click.ClickException("no measured request succeeded")


def medians_table(result: dict, path: Path):
    from rich.table import Table

    res, config = result["results"], result["config"]
    title = (
        f"evalpipe bench — {config['model']} in={config['input_len']} out={config['output_len']} "
        f"c={config['concurrency']}"
    )
    # one row per metric: its median and range over the measured requests (rounds for the aggregate); every value
    # is in bench.json, as a C64 run has hundreds
    t = Table(title=title, caption=f"every request's and round's value: {path}")
    for col in ("metric", "median", "min", "max", "n"):
        t.add_column(col, justify="left" if col == "metric" else "right")

    def add(name: str, median, values: list) -> None:
        ends = (min(values), max(values)) if values else (None, None)
        cells = ["n/a" if v is None else f"{v:.4g}" for v in (median, *ends)]
        t.add_row(name, *cells, str(len(values)))

    for name in ("decode_tokens_per_s", "ttft_s", "total_s", "aggregate_tokens_per_s"):
        add(name, res[name]["median"], res[name]["values"])
    if res["accept_length_values"]:
        add("accept_length", res["accept_length_median"], res["accept_length_values"])
    run_level = res.get("spec_metrics") or {}
    if run_level.get("mean_accept_length") is not None:
        # server counters over the measured rounds, not per request
        t.add_row("accept_length (run-level, /metrics)", f"{run_level['mean_accept_length']:.4g}", "", "", "")
    return t
