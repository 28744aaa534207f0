"""`evalpipe qualify --base-url URL`: serving qualification gates (flags only; the gates live in evalpipe/qualify/)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from evalpipe.harness.client import DEFAULT_BASE_URL
from evalpipe.qualify import EXIT_BAD_INPUT, GATES

# reference joins when a reference file is named; sampling (a minute of sampled tokens), vision (for
# vision-language models) and kv-pressure (prompts past the whole KV pool) only when asked for
DEFAULT_GATES = tuple(g for g in GATES if g not in ("reference", "sampling", "vision", "kv-pressure"))


def _gates(ctx, param, value):
    if value is None:
        return None
    names = [g.strip() for g in value.split(",") if g.strip()]
    if names == ["all"]:
        return GATES
    unknown = [g for g in names if g not in GATES]
    if unknown or not names:
        raise click.BadParameter(
            f"unknown gate(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(GATES)} or 'all'"
        )
    return tuple(names)


HELP = """Qualify a serving stack: run the gates against any OpenAI-compatible server and write qualify.json (every
request, its checks and verdict), manifest.json and report.html; print one table of the gates.

\b
Gates:
  auth        every --api-key accepted, missing and wrong keys refused, on every route (skipped, with the
              reason, when no --api-key is given)
  reference   --record-reference / --reference: 20 greedy fixtures against an earlier boot
  retrieval   exact needle answers with a normal stop at several depths, prompts filling --max-context
              tokens (counted by the server's /tokenize), in chat or completion form (--prompt-form)
  boundaries  prompts at +-1 of chunk, page, window and compression sizes equal their solo runs (cold
              cache: a flush, else a fresh random tag leading every prompt)
  mixed       a long prompt arriving during C short decodes: every output equals its solo run
  structured  tool calls (auto, required, named), tool results, json_schema; streamed and not; serial and C
  soak        C streams for --soak-duration s: no failures, no hangs; output-cap hits, memory sampled
  sampling    T=1 samples with top-20 logprobs: the randomised PIT of every sampled token is uniform
              (chi-square), argmax and context-repeat hits match their probabilities (two z-tests), each
              at alpha 0.001; needs logprobs. sampling_tokens.jsonl beside qualify.json holds per response
              the tokens, logprobs, top-20 and PIT draws, from which every p-value can be recomputed
  vision      three PNG images as data URLs in chat image_url parts, greedy: the same image twice gives
              the same output, different images give different outputs or first-token logprobs (a
              server that drops images fails); skipped, with the reason, when the server refuses image
              content with a 400 naming it (a text-only model)
  kv-pressure long needle prompts past 1.2x the KV pool (--kv-pool-tokens, else what the server exposes),
              serially, then C at once, then the last one again: the same greedy output every time, and
              cached prompt tokens reported on the reuse (only when asked for)

\b
Exit codes:
  0    every selected gate passed (or was skipped, as auth without --api-key, vision on a text-only server)
  2    bad input: a flag, an unreadable --reference, an unknown --model, a refused key, a used --out
  3    cannot connect: the endpoint is unreachable or not OpenAI-compatible
  4    the gates ran and at least one failed (or the server's settings changed during the run)
  130  interrupted (what ran is written)
"""


@click.command(name="qualify", help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--base-url",
    default=DEFAULT_BASE_URL,
    show_default=True,
    help="OpenAI-compatible endpoint including /v1 (the default is where `evalpipe serve` listens).",
)
@click.option("--model", default=None, help="Model id to request. Default: the first id from /v1/models.")
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    envvar="EVALPIPE_API_KEY",
    help="A key the server accepts; repeat it for every key the server is configured with (the auth gate "
    "checks each on every route; generation uses the first). Env EVALPIPE_API_KEY. Never recorded.",
)
@click.option(
    "--gates",
    callback=_gates,
    default=None,
    metavar="G1,G2",
    help=f"Gates to run, comma-separated, or 'all': {', '.join(GATES)}. Default: every gate but "
    "reference, sampling, vision and kv-pressure, plus reference when --record-reference or --reference is given.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for qualify.json, manifest.json and report.html (created; one that already holds a "
    "qualify.json is refused). Default: results/qualify/<UTC time>.",
)
@click.option(
    "--record-reference",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Record 20 greedy fixtures (first token and up to 48 tokens: ids, text, logprobs) with the "
    "server's receipt into this file.",
)
@click.option(
    "--reference",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Compare against a recorded reference: first-token and continuation agreement, first "
    "divergence and logprob gap per fixture; passes on 20/20 and 20/20.",
)
@click.option(
    "--max-context",
    type=click.IntRange(0),
    default=0,
    help="Longest prompt + reply in tokens for retrieval and mixed (bytes are tokens for the default "
    "byte-level model). Default (0): the server's max_model_len from /v1/models, else 4096.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 512),
    default=8,
    show_default=True,
    help="Requests in flight for the C-way parts: mixed's short decodes, structured's parallel round, "
    "the soak, the reference and retrieval requests.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(1),
    default=32,
    show_default=True,
    help="Greedy continuation length compared by boundaries and mixed.",
)
@click.option(
    "--retrieval-depths",
    type=click.IntRange(3, 64),
    default=4,
    show_default=True,
    help="Needle depths, from just before the question to the front of a --max-context prompt.",
)
@click.option(
    "--needles-per-depth",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    help="Retrieval prompts (each with its own needle and filler) at every needle depth.",
)
@click.option(
    "--receipt",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The launch receipt `evalpipe serve` wrote for this server: boundaries and kv-pressure read sizes from it "
    "(its server report, the engine flags of its argv, the model's config.json). Default: the newest receipt in "
    "results/receipts/ of a server still running at --base-url's address, if any.",
)
@click.option(
    "--kv-pool-tokens",
    type=click.IntRange(1),
    default=None,
    help="KV pool size in tokens for kv-pressure. Default: what the server exposes (evalpipe's kv_pool in "
    "/get_server_info, SGLang's max_total_num_tokens, vLLM's vllm:cache_config_info in /metrics, the receipt).",
)
@click.option(
    "--prompt-form",
    "retrieval_prompt_form",
    type=click.Choice(["auto", "chat", "completions"]),
    default="auto",
    show_default=True,
    help="Retrieval's prompts: chat (the model's chat template; the message asks for the code only) or "
    "completions ('Question: ... Answer:', the default model's format). auto: completions for a byte-level "
    "tokenizer (evalpipe's own models), else chat when the server renders a chat through /tokenize, else "
    "completions. The fill is counted with /tokenize (bytes where the server has none).",
)
@click.option(
    "--chunk-size",
    type=click.IntRange(2),
    default=None,
    help="Prefill chunk size for boundaries. Default: what the server exposes (see --receipt).",
)
@click.option(
    "--page-size",
    type=click.IntRange(2),
    default=None,
    help="KV page size for boundaries. Default: what the server exposes (/get_server_info, vLLM's /metrics "
    "block size, the receipt).",
)
@click.option(
    "--sliding-window",
    type=click.IntRange(2),
    default=None,
    help="Sliding attention window for boundaries. Default: what the server exposes (see --receipt).",
)
@click.option(
    "--compress-ratio",
    "compress_ratios",
    type=click.IntRange(2),
    multiple=True,
    help="A KV compression ratio for boundaries (repeatable). Default: what the server exposes.",
)
@click.option(
    "--soak-duration",
    "soak_s",
    type=click.FloatRange(0.1),
    default=120.0,
    show_default=True,
    help="Seconds the soak keeps --concurrency streams in flight.",
)
@click.option(
    "--hang-timeout",
    "hang_s",
    type=click.FloatRange(0.1),
    default=60.0,
    show_default=True,
    help="A stream with no event for this many seconds is a hang (soak and mixed).",
)
@click.option(
    "--soak-max-tokens",
    type=click.IntRange(1),
    default=64,
    show_default=True,
    help="max_tokens of each soak request; replies ending there count as output-cap hits.",
)
@click.option(
    "--sample-every",
    "sample_every_s",
    type=click.FloatRange(0.1),
    default=2.0,
    show_default=True,
    help="Seconds between MemAvailable / server RSS samples during the soak.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0.001),
    default=600.0,
    show_default=True,
    help="Per-request timeout in seconds.",
)
@click.option(
    "--sampling-tokens",
    type=click.IntRange(1),
    default=12000,
    show_default=True,
    help="Sampled tokens the sampling gate tests (30-40 s on the CPU default server; more tokens, more "
    "power against a subtly wrong sampler).",
)
@click.option(
    "--sampling-seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the sampling gate's prompts, its PIT randomisation and the requests' `seed` fields.",
)
@click.option("--no-progress", is_flag=True, help="No soak progress bar (it is drawn on a terminal only).")
def command(**opts):
    from evalpipe.qualify.report import print_table
    from evalpipe.qualify.run import QualifyError, execute

    try:
        code, result = execute(qualify_config(opts))
    except QualifyError as exc:
        click.echo(f"evalpipe qualify: {exc}", err=True)
        sys.exit(exc.code)
    print_table(result)
    sys.exit(code)


def qualify_config(opts: dict):
    """The QualifyConfig of the command line: the default gates (plus reference with a reference file), a dated
    --out, the keys kept out of the recorded command line."""
    from evalpipe.qualify.core import QualifyConfig
    from evalpipe.redact import redact_argv

    gates = opts["gates"]
    if gates is None:
        gates = DEFAULT_GATES + (("reference",) if opts["record_reference"] or opts["reference"] else ())
    out_dir = opts["out_dir"] or Path("results") / "qualify" / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    passed = {
        k: v for k, v in opts.items() if k not in ("gates", "out_dir", "api_keys", "compress_ratios", "no_progress")
    }
    return QualifyConfig(
        gates=gates,
        out_dir=out_dir,
        api_keys=tuple(opts["api_keys"]),
        compress_ratios=tuple(opts["compress_ratios"]),
        command_line=redact_argv(sys.argv, list(opts["api_keys"])),
        progress=not opts["no_progress"],
        **passed,
    )


assert EXIT_BAD_INPUT == 2  # click's own usage errors exit 2 too: one code for bad input
