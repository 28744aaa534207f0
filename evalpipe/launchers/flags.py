"""The serve flags, defined once, and every rule about them.

`evalpipe serve` (commands/serve.py: the native engine in this process, or any engine through a launcher) and the
arms of `evalpipe ab` (`parse_serve_args`) parse this one table. Four groups:
- COMMON: every engine (model, address, dtype/device, batch, key, speculation, lossy acceptance);
- NATIVE: the native engine's own settings; a launcher passes them on to its server unchanged;
- LAUNCH: how a launcher starts sglang/vllm (parallelism, their speculation trees, environment, interpreter);
- RUN: how one launch runs (dry run, readiness, receipt, log); `evalpipe ab` sets these itself.

The rules the flags obey are in rules.py, one place each, for a native in-process server and the launchers alike.
Every field of the native engine's `EngineConfig` (engine/config.py) is a flag of the same name whose default is the
field's (`ENGINE_DEFAULTS`), or None ("not given": each engine's own default) for the flags all engines share, whose
help then states the native default; tests/engine/test_engine_config.py checks both.
"""

from __future__ import annotations

import dataclasses
import shlex

import click
from click.core import ParameterSource

from evalpipe.engine.config import DEFAULT_TOKENS_PER_STEP, GATHER_CAP, LONE_SHARE, EngineConfig
from evalpipe.engine.config import ENGINE_DEFAULTS as D
from evalpipe.engine.faults import DEBUG_FAULTS, DEVICE_ASSERT_SEED
from evalpipe.launchers import ENGINES
from evalpipe.launchers.base import LaunchOptions
from evalpipe.launchers.env import parse_assignments
from evalpipe.launchers.errors import LaunchConfigError

SPECULATION_PROFILES = ("off", "block", "dspark", "eagle", "eagle3", "nextn", "ngram")


def _pos_int(ctx, param, value):
    if value is not None and value < 1:
        raise click.BadParameter("must be >= 1")
    return value


option = click.option
COMMON = [
    option(
        "--engine",
        type=click.Choice(ENGINES),
        default="native",
        show_default=True,
        help="Which server: native (this package's engine, served in this process), sglang or vllm (through a "
        "launcher).",
    ),
    option(
        "--model",
        "--model-path",
        "model",
        default=None,
        metavar="PATH|NAME",
        help="native: a checkpoint directory (config.json + *.safetensors, DeepSeek-V4 format) or a built-in model: "
        "evalpipe-skills-dsv4 (the default: 7.8 M parameters trained on evalpipe's synthetic skills, shipped in "
        "the package), evalpipe-skills-dsv4-w64 (the earlier default: window 64, does not copy) or "
        "evalpipe-tiny-dsv4 (random weights, nonsense answers; for tests). sglang/vllm: "
        "required, the model path or id.",
    ),
    option(
        "--tokenizer",
        "--tokenizer-path",
        "tokenizer",
        default=None,
        metavar="PATH",
        help="Tokenizer, when it differs from the model. native: a Hugging Face tokenizer directory (local files); "
        "default: the model directory's tokenizer if it has one, else the built-in byte-level tokenizer.",
    ),
    option("--host", default="127.0.0.1", show_default=True, help="Address the server binds."),
    option(
        "--port",
        default=30000,
        show_default=True,
        type=click.IntRange(0, 65535),
        help="Port the server binds (native: 0 picks a free one; `ab` picks a free one unless given).",
    ),
    option(
        "--dtype",
        default=None,
        help="Weight/activation dtype. native: float32 or bfloat16 "
        f"[default: {D.dtype}]; sglang/vllm: passed to the engine.",
    ),
    option("--device", default=None, help=f"native: where the model runs, cpu or cuda [default: {D.device}]."),
    option(
        "--max-batch",
        type=int,
        callback=_pos_int,
        default=None,
        help=f"native: most sequences running at once (each choice of a request is one sequence) "
        f"[default: {D.max_batch}].",
    ),
    option(
        "--api-key",
        "api_key",
        multiple=True,
        metavar="KEY",
        help="Require 'Authorization: Bearer KEY' (native: all routes but /health*; also read from "
        "EVALPIPE_API_KEY). native: repeat it to accept any of several keys (key rotation, one key per "
        "client); sglang/vllm take one. Redacted in every receipt and printout.",
    ),
    option(
        "--speculative",
        type=click.Choice(SPECULATION_PROFILES),
        default=None,
        help=f"Speculation profile [default: {D.speculative}]. native: off | block (block speculative decoding: each "
        "step drafts G tokens per sequence and verifies the last token plus the G drafts, G+1 rows, in one target "
        "forward); sglang: off | dspark | eagle | eagle3 | nextn; vllm: the same plus ngram.",
    ),
    option(
        "--block-size",
        type=int,
        callback=_pos_int,
        default=None,
        metavar="G",
        help=f"native: drafts per verify step with --speculative block, 1..16 [default: {D.block_size}]; sglang: "
        "the dspark block size; vllm: dspark draft tokens.",
    ),
    option(
        "--drafter",
        default=None,
        metavar="SPEC",
        help="native, with --speculative block: layerskip:N (the target's first N layers + final norm and head), "
        "model:PATH (a separate small checkpoint, same tokenizer), ngram (prompt lookup), self (the target "
        "itself; 100% greedy acceptance). Default: layerskip over three quarters of the layers (layerskip:3 "
        "for the tiny model).",
    ),
    option(
        "--simulate-acc-len",
        type=float,
        default=None,
        metavar="X",
        help="PERFORMANCE ONLY: accept a floor/ceil mix of X-1 drafts per step (mean exactly X, bonus included) "
        "without checking them (native flag, SGLANG_SIMULATE_ACC_LEN, vLLM's synthetic sampler). Reported in "
        "/get_server_info and every response; output quality is meaningless, so `evalpipe run` refuses to "
        "score against it.",
    ),
    option(
        "--spec-accept-topk",
        type=int,
        default=None,
        metavar="K",
        help="LOSSY, evaluation only (proves an eval catches a lossy speculator), native only: accept a draft when "
        "it is among the target's top K tokens at its row (K >= 2; K = 1 is the default exact greedy rule). "
        "Greedy requests rank the logits; sampled requests keep a top-K draft without the rejection test. "
        "Reported as lossy in /get_server_info, every `spec`, the ready line and the receipt. Default: exact.",
    ),
    option(
        "--spec-accept-threshold-single",
        type=float,
        default=None,
        metavar="P",
        help="LOSSY below 1.0, evaluation only (native, sglang --speculative-accept-threshold-single): on sampled "
        "requests accept a draft whose target probability is >= P (greedy requests stay exact, as in SGLang). "
        "1.0 (with --spec-accept-threshold-acc 1.0) is lossless and keeps the exact rule.",
    ),
    option(
        "--spec-accept-threshold-acc",
        type=float,
        default=None,
        metavar="P",
        help="LOSSY below 1.0, evaluation only (native, sglang --speculative-accept-threshold-acc): on sampled "
        "requests accept a draft with probability min(1, p(draft) / P) instead of the exact test (SGLang's "
        "target-only rule; greedy requests stay exact).",
    ),
    option(
        "--deterministic",
        is_flag=True,
        default=D.deterministic,
        help="Ask the engine for batch-invariant inference (the aim: a greedy output that depends on its prompt "
        "alone, not on the batch it lands in, the concurrency, prefix-cache hits or speculation). native: asks for "
        "batch-invariant kernels (their tests: tests/kernels/test_batch_invariant.py) and samples with keyed noise "
        "(a function of seed, output index and token id; a sampled request without a seed gets one, reported as "
        "each choice's `seed`), verifying sampled speculation by sample-verify, so a seeded T > 0 output is the "
        "same with speculation on and off (tests/engine/test_seeded_replay.py); sglang: "
        "--enable-deterministic-inference; vllm: VLLM_BATCH_INVARIANT=1. Off by default. Reported as "
        "`deterministic` in the receipt, the run manifest and every record (native: also /get_server_info).",
    ),
]
NATIVE = [
    option(
        "--max-tokens-per-step",
        default=None,
        type=click.IntRange(1),
        help="native: rows per forward: decode rows plus prompt-chunk rows (the prefill chunk size). Default: "
        f"{DEFAULT_TOKENS_PER_STEP['cpu']} on the CPU, {DEFAULT_TOKENS_PER_STEP['cuda']} with --device cuda "
        "(SGLang's chunked-prefill size on large GPUs: on the H200 a 3500-token prompt prefills 4.7x faster in one "
        "chunk than in 512-row chunks).",
    ),
    option(
        "--max-queue",
        default=D.max_queue,
        show_default=True,
        type=click.IntRange(0),
        help="native: most sequences waiting for a slot; beyond it requests get 503 with Retry-After.",
    ),
    option(
        "--max-seq-len",
        default=D.max_seq_len,
        show_default=True,
        type=click.IntRange(2),
        help="native: longest prompt + completion per sequence, in tokens.",
    ),
    option(
        "--docs",
        is_flag=True,
        help="native: serve the interactive API docs (/docs, /redoc, /openapi.json); off by default. With "
        "--api-key they need the key like every other route.",
    ),
    option(
        "--fused",
        default=D.fused,
        show_default=True,
        type=click.Choice(["on", "off"]),
        help="native, with --device cuda: route the verify (and decode) steps through the fused Triton kernels of "
        "evalpipe.kernels (on) or the engine's reference PyTorch chains (off), to A/B fusion in one build. On "
        "the CPU the reference chains always run.",
    ),
    option(
        "--cuda-graphs",
        default=D.cuda_graphs,
        show_default=True,
        type=click.Choice(["on", "off"]),
        help="native, with --device cuda: capture the decode and (G+1)-row verify steps as CUDA graphs per batch "
        "bucket at start-up and replay them (off: run the same static steps eagerly).",
    ),
    option(
        "--prefix-cache",
        default=D.prefix_cache,
        show_default=True,
        type=click.Choice(["on", "off"]),
        help="native: reuse the state of shared prompt prefixes across requests (full pages of compressed-KV entries "
        "and indexer keys shared by reference count, sliding-window and compressor rows restored at the page "
        "edge; LRU eviction when pages run short). Exact: greedy outputs equal those with it off. Hits show in "
        "usage.prompt_tokens_details.cached_tokens; POST /flush_cache drops it.",
    ),
    option(
        "--overlap-schedule",
        default=D.overlap_schedule,
        show_default=True,
        type=click.Choice(["on", "off"]),
        help="native, with --device cuda: queue each greedy decode step before the previous step's tokens reach the "
        "host (fed on the device), so stop checks, detokenizing and streaming run while the GPU computes "
        "(SGLang's overlap scheduler). Exact: the same tokens as off; a stop is seen one step late and its extra "
        "row discarded. Steps with prompt chunks, sampling, grammars, logprobs or speculation run as before.",
    ),
    option(
        "--prefill-delay-factor",
        default=D.prefill_delay_factor,
        show_default=True,
        type=click.FloatRange(0),
        metavar="F",
        help="native: while sequences decode, admit new prompts only once F x (the last prompt step's time) has passed "
        "since it ended, or when a full --max-tokens-per-step chunk of them is waiting (vLLM's "
        "--scheduler-delay-factor). Fewer, larger prompt chunks: each prompt step stalls every decoding "
        "sequence, and on a GPU a small chunk costs nearly as much as a large one. Trades time to first token "
        "for throughput; 0 admits at every step.",
    ),
    option(
        "--burst-wait-ms",
        default=D.burst_wait_ms,
        show_default=True,
        type=click.FloatRange(0),
        metavar="MS",
        help="native: when requests reach an idle engine, it keeps taking them until MS ms pass without a new one "
        f"(at most {GATHER_CAP} x MS in all) before its first step, so a burst (a benchmark round, an eval's first "
        "wave) starts as one prompt step instead of several small ones. While it holds a lone request it waits "
        f"MS / {LONE_SHARE} for a second, so a client that sends one request at a time pays that on each first "
        "token, and a burst up to the whole wait; 0 steps at once.",
    ),
    option(
        "--stream-interval",
        default=D.stream_interval,
        show_default=True,
        type=click.IntRange(1),
        metavar="N",
        help="native: after a sequence's first token, send its tokens in events of N (the last one may be shorter; "
        "SGLang's --stream-interval). A stream then has about N times fewer chunks for the server and the "
        "client to handle, at N steps between chunks; tokens, text and usage are the same. Non-streamed "
        "responses are unchanged.",
    ),
    option(
        "--wo-quant",
        default=D.wo_quant,
        show_default=True,
        type=click.Choice(["none", "mxfp8"]),
        help="native: output projection of every attention layer. mxfp8: WO-A through the fused wo_a_mxfp8 kernel "
        "(bf16 rounding, MXFP8 activations) and WO-B through mxfp8_linear on o_b weights quantized to MXFP8 "
        "once at load. LOSSY: outputs differ from the unquantized model (and from the transformers oracle). "
        "Triton on CUDA where the kernels' guards pass (bf16), their PyTorch references elsewhere (CPU). "
        "Reported in /get_server_info (wo_quant, fused_sites).",
    ),
    option(
        "--threads",
        default=D.threads,
        show_default=True,
        type=click.IntRange(1),
        metavar="N",
        help="native: torch intra-op threads of the engine process for --device cpu (the HTTP process runs no torch "
        "op). One by default: the tiny model is op-overhead bound "
        "(2 threads gave the same prefill speed here) and extra OpenMP threads fight the client and other "
        "processes on small machines (a request took 20-50x longer under contention).",
    ),
    option(
        "--debug-fault",
        "debug_faults",
        multiple=True,
        default=D.debug_faults,
        type=click.Choice(list(DEBUG_FAULTS)),
        metavar="NAME",
        help="native, EVALUATION OF EVALUATIONS ONLY (never on by default; repeatable): plant a known speculative-"
        "decoding bug to show which check notices it, or a broken device. greedy-sampling (verify takes the "
        "argmax for sampled requests), residual-from-target (on rejection resample from p, not max(0, p - "
        "q)), stale-kv-after-reject (rejected drafts stay in the target's cache): these three need "
        "--speculative block. batch-variant (the LM head's reduction is split by the batch's row count, "
        "bfloat16 partial sums: tokens change with concurrency; --device cpu only). device-assert (a step "
        f"with a request seeded {DEVICE_ASSERT_SEED} reads past a device tensor's end: on CUDA a device-side "
        "assert, after which the engine exits and the server answers 503 engine_dead and exits 1; on the CPU "
        "an IndexError fails that step and serving goes on). Reported as debug_faults in /get_server_info, "
        "every choice's `spec`, the ready line and the receipt; `evalpipe run` warns.",
    ),
    option(
        "--log-level",
        default="warning",
        show_default=True,
        type=click.Choice(["debug", "info", "warning", "error"]),
        help="native: server log verbosity. info adds the engine's rates every 10 s of work (steps, steps with "
        "prompt chunks and their rows, generated and prefilled tok/s, time per loop beside Engine.step's, and "
        "Engine.step's time over decode-only steps and over steps with prompt chunks, each apart).",
    ),
]
LAUNCH = [
    option(
        "--tp",
        "--tp-size",
        "tp",
        type=int,
        callback=_pos_int,
        help="Tensor-parallel size (sglang --tp-size, vllm --tensor-parallel-size).",
    ),
    option(
        "--ep",
        "--ep-size",
        "ep",
        type=int,
        callback=_pos_int,
        help="Expert-parallel size (sglang --ep-size; vllm: must equal TP x DP, enables expert parallel).",
    ),
    option(
        "--dp",
        "--dp-size",
        "dp",
        type=int,
        callback=_pos_int,
        help="Data-parallel size (sglang --dp-size, vllm --data-parallel-size).",
    ),
    option(
        "--draft-model",
        help="sglang/vllm draft model path (--speculative-draft-model-path / speculative-config model).",
    ),
    option(
        "--spec-steps",
        type=int,
        callback=_pos_int,
        help="eagle/eagle3/nextn: draft depth (--speculative-num-steps); vllm ngram: draft tokens per step.",
    ),
    option(
        "--spec-topk", type=int, callback=_pos_int, help="eagle/eagle3/nextn: branching (--speculative-eagle-topk)."
    ),
    option(
        "--spec-draft-tokens",
        type=int,
        callback=_pos_int,
        help="eagle/eagle3/nextn: tokens verified per step (--speculative-num-draft-tokens).",
    ),
    option("--keep-env", multiple=True, help="Keep an inherited SGLANG_*/VLLM_* variable (name or glob; repeatable)."),
    option(
        "--set-env",
        multiple=True,
        help="Set NAME=VALUE in the server environment on purpose (repeatable), e.g. SGLANG_ENABLE_SPEC_V2=True.",
    ),
    option(
        "--engine-python",
        type=click.Path(dir_okay=False),
        help="sglang/vllm: the python of the environment where the engine lives, e.g. .venv-vllm/bin/python "
        "[default: this one if it imports the engine, else the one behind `sglang`/`vllm` on PATH].",
    ),
    option(
        "--engine-command",
        help="Replace the program prefix, e.g. 'srun -N2 ./sglang_node.sh' (shell-split); not with --engine-python.",
    ),
    option(
        "--ngram-min",
        type=int,
        callback=_pos_int,
        help="vllm ngram: shortest prompt n-gram to match (prompt_lookup_min) [default: vLLM's].",
    ),
    option(
        "--ngram-max",
        type=int,
        callback=_pos_int,
        help="vllm ngram: longest prompt n-gram to match (prompt_lookup_max) [default: vLLM's].",
    ),
    option(
        "--tool-call-parser",
        default=None,
        metavar="NAME|off",
        help="vllm: the tool-call parser passed with --enable-auto-tool-choice (vLLM needs both to answer "
        "tool_choice auto). Default: from the model folder's chat template (<tool_call> or ChatML: hermes; Llama 3 "
        "headers: llama3_json; [TOOL_CALLS]: mistral; none of them: no tool flags). off: no tool flags. "
        "Either flag given after `--` wins.",
    ),
]
RUN = [
    option(
        "--dry-run",
        is_flag=True,
        help="Print the command and environment, start nothing (the only way to exercise "
        "sglang/vllm where they are not installed).",
    ),
    option("--json", "as_json", is_flag=True, help="With --dry-run: print it as JSON."),
    option(
        "--ready-timeout",
        type=float,
        default=900.0,
        show_default=True,
        help="Launcher: seconds to wait for the health check.",
    ),
    option(
        "--receipt",
        type=click.Path(dir_okay=False),
        help="Launcher: receipt JSON path [default: results/receipts/ENGINE-TIME.json].",
    ),
    option(
        "--log-file",
        type=click.Path(dir_okay=False),
        help="Launcher: server log path [default: next to the receipt, .log].",
    ),
]
EXTRA = click.argument("extra_args", nargs=-1, type=click.UNPROCESSED)
CONTEXT = {"ignore_unknown_options": True, "help_option_names": ["-h", "--help"]}


def serve_flags(func):
    """Every serve flag (the four groups) plus the passthrough arguments, on a click command function."""
    for option in reversed(COMMON + NATIVE + LAUNCH + RUN):
        func = option(func)
    return EXTRA(func)


def _param(option) -> click.Parameter:
    return option(lambda: None).__click_params__[0]


NATIVE_PARAMS = [_param(o) for o in NATIVE]
RUN_PARAMS = [_param(o) for o in RUN]
LAUNCH_NAMES = {_param(o).name for o in LAUNCH + RUN} - {"dry_run", "as_json"}


def given(ctx: click.Context) -> set[str]:
    """Names of the parameters set on the command line."""
    return {name for name in ctx.params if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}


def needs_launcher(params: dict, given_names: set[str]) -> bool:
    """A launch: another engine, a dry run, or any launcher flag; otherwise the native engine in this process."""
    return params["engine"] != "native" or params["dry_run"] or bool(given_names & LAUNCH_NAMES)


def native_argv(params: dict, given_names: set[str]) -> list[str]:
    """The native-only flags given, as a launched server's command line takes them (passed on unchanged)."""
    argv: list[str] = []
    for p in NATIVE_PARAMS:
        if p.name in given_names:
            flag = p.opts[0]
            if p.multiple:
                argv += [a for value in params[p.name] for a in (flag, str(value))]
            else:
                argv += [flag] if p.is_flag else [flag, str(params[p.name])]
    return argv


def options_from_params(params: dict, given_names: set[str]) -> LaunchOptions:
    """LaunchOptions from parsed serve flags; raises LaunchConfigError on malformed --set-env."""
    values = {f.name: params[f.name] for f in dataclasses.fields(LaunchOptions) if f.name in params}
    keys = tuple(params.get("api_key") or ())
    values.update(api_key=keys[0] if keys else None, more_api_keys=keys[1:])
    command = params["engine_command"]
    values.update(
        keep_env=tuple(params["keep_env"]),
        set_env=parse_assignments(params["set_env"]),
        engine_command=tuple(shlex.split(command)) if command else None,
        extra_args=tuple(native_argv(params, given_names)) + tuple(params["extra_args"]),
        native=EngineConfig.from_values(params) if params["engine"] == "native" else None,
    )
    return LaunchOptions(**values)


def parse_serve_args(argv: list[str]) -> tuple[LaunchOptions, set[str]]:
    """Parse one arm's server arguments as `evalpipe serve` would.

    Returns the options and the names of the flags given on the command line (for declaring A/B differences).
    """
    command = serve_flags(click.command("serve", context_settings=CONTEXT)(lambda **_: None))
    ctx = command.make_context("serve", list(argv), resilient_parsing=False)
    names = given(ctx)
    for p in RUN_PARAMS:
        if p.name in names:
            raise click.UsageError(f"{p.opts[0]} is set by `evalpipe ab` itself, not in an arm")
    try:
        return options_from_params(ctx.params, names), names
    except LaunchConfigError as exc:
        raise click.UsageError(str(exc)) from None
