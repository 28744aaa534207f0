"""`evalpipe serve`: the native engine behind an OpenAI-compatible HTTP API.

The port opens first and the model loads on a background thread (health routes answer 503 meanwhile); the
ready line with the URL is printed once weights are loaded and the engine thread runs. Ctrl-C or SIGTERM stops
uvicorn, then the engine, and the command exits 0.
"""

from __future__ import annotations

import logging
import signal
import socket
import sys

import click

DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")


@click.command("serve", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model", default=None, metavar="PATH|NAME",
              help="Checkpoint directory (config.json + *.safetensors, DeepSeek-V4 format) or a built-in model: "
                   "evalpipe-skills-dsv4 (the default: 7.8 M parameters trained on evalpipe's synthetic skills, "
                   "shipped in the package) or evalpipe-tiny-dsv4 (random weights, nonsense answers; for tests).")
@click.option("--tokenizer", default=None, metavar="PATH",
              help="Hugging Face tokenizer directory (local files). Default: the model directory's tokenizer "
                   "if it has one, else the built-in byte-level tokenizer.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", default=30000, show_default=True, type=click.IntRange(0, 65535),
              help="Port to bind (0 picks a free one).")
@click.option("--dtype", default="float32", show_default=True, type=click.Choice(DTYPES), help="Weight/activation dtype.")
@click.option("--device", default="cpu", show_default=True, type=click.Choice(DEVICES), help="Where the model runs.")
@click.option("--max-batch", default=64, show_default=True, type=click.IntRange(1),
              help="Most sequences running at once (each choice of a request is one sequence).")
@click.option("--max-tokens-per-step", default=512, show_default=True, type=click.IntRange(1),
              help="Rows per forward: decode rows plus prompt-chunk rows (the prefill chunk size).")
@click.option("--max-queue", default=1024, show_default=True, type=click.IntRange(0),
              help="Most sequences waiting for a slot; beyond it requests get 503 with Retry-After.")
@click.option("--max-seq-len", default=4096, show_default=True, type=click.IntRange(2),
              help="Longest prompt + completion per sequence, in tokens.")
@click.option("--api-key", default=None, envvar="EVALPIPE_API_KEY", metavar="KEY",
              help="Require 'Authorization: Bearer KEY' (all routes but /health*). Also read from EVALPIPE_API_KEY.")
@click.option("--docs", is_flag=True,
              help="Serve the interactive API docs (/docs, /redoc, /openapi.json); off by default. With --api-key "
                   "they need the key like every other route.")
@click.option("--speculative", default="off", show_default=True, type=click.Choice(["off", "block"]),
              help="Block speculative decoding: each step drafts G tokens per sequence and verifies the last token "
                   "plus the G drafts (G+1 rows, request-major) in one target forward.")
@click.option("--block-size", default=5, show_default=True, type=click.IntRange(1, 16), metavar="G",
              help="Drafts per verify step with --speculative block.")
@click.option("--drafter", default=None, metavar="SPEC",
              help="Who drafts with --speculative block: layerskip:N (the target's first N layers + final norm "
                   "and head), model:PATH (a separate small checkpoint, same tokenizer), ngram (prompt lookup), "
                   "self (the target itself; 100% greedy acceptance). Default: layerskip over three quarters "
                   "of the layers (layerskip:3 for the tiny model).")
@click.option("--simulate-acc-len", default=None, type=float, metavar="X",
              help="Performance runs only: accept a floor/ceil mix of X-1 drafts per step (mean exactly X, bonus "
                   "included) without checking them. Reported in /get_server_info and every response; output "
                   "quality is meaningless, so `evalpipe run` refuses to score against it.")
@click.option("--spec-accept-topk", "spec_accept_topk", default=None, type=int, metavar="K",
              help="LOSSY, evaluation only (proves an eval catches a lossy speculator): with --speculative block "
                   "accept a draft when it is among the target's top K tokens at its row (K >= 2; K = 1 is the "
                   "default exact greedy rule). Greedy requests rank the logits; sampled requests keep a top-K draft "
                   "without the rejection test. Reported as lossy in /get_server_info, every `spec` and the ready "
                   "line. Default: exact acceptance.")
@click.option("--spec-accept-threshold-single", "spec_accept_threshold_single", default=None,
              type=click.FloatRange(0.0, 1.0), metavar="P",
              help="LOSSY below 1.0, evaluation only: SGLang's --speculative-accept-threshold-single. On sampled "
                   "requests accept a draft whose target probability is >= P (greedy requests stay exact, as in "
                   "SGLang). 1.0 (with --spec-accept-threshold-acc 1.0) is lossless and keeps the exact rule.")
@click.option("--spec-accept-threshold-acc", "spec_accept_threshold_acc", default=None,
              type=click.FloatRange(0.0, 1.0), metavar="P",
              help="LOSSY below 1.0, evaluation only: SGLang's --speculative-accept-threshold-acc. On sampled "
                   "requests accept a draft with probability min(1, p(draft) / P) instead of the exact test "
                   "(SGLang's target-only rule; greedy requests stay exact).")
@click.option("--fused", default="on", show_default=True, type=click.Choice(["on", "off"]),
              help="With --device cuda: route the verify (and decode) steps through the fused Triton kernels of "
                   "evalpipe.kernels (on) or the engine's reference PyTorch chains (off), to A/B fusion in one "
                   "build. On the CPU the reference chains always run.")
@click.option("--cuda-graphs", default="on", show_default=True, type=click.Choice(["on", "off"]),
              help="With --device cuda: capture the decode and (G+1)-row verify steps as CUDA graphs per batch "
                   "bucket at start-up and replay them (off: run the same static steps eagerly).")
@click.option("--wo-quant", default="none", show_default=True, type=click.Choice(["none", "mxfp8"]),
              help="Output projection of every attention layer. mxfp8: WO-A through the fused wo_a_mxfp8 kernel "
                   "(bf16 rounding, MXFP8 activations) and WO-B through mxfp8_linear on o_b weights quantized to "
                   "MXFP8 once at load. LOSSY: outputs differ from the unquantized model (and from the "
                   "transformers oracle). Triton on CUDA where the kernels' guards pass (bf16), their PyTorch "
                   "references elsewhere (CPU). Reported in /get_server_info (wo_quant, fused_sites).")
@click.option("--threads", default=1, show_default=True, type=click.IntRange(1), metavar="N",
              help="torch intra-op threads for --device cpu. One by default: the tiny model is op-overhead bound "
                   "(2 threads gave the same prefill speed here) and extra OpenMP threads fight the client and "
                   "other processes on small machines (a request took 20-50x longer under contention).")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="Server log verbosity.")
def command(model, tokenizer, host, port, dtype, device, max_batch, max_tokens_per_step, max_queue, max_seq_len,
            api_key, docs, speculative, block_size, drafter, simulate_acc_len, spec_accept_topk,
            spec_accept_threshold_single, spec_accept_threshold_acc, fused, cuda_graphs, wo_quant, threads, log_level):
    """Serve a model (the built-in evalpipe-skills-dsv4 by default) on http://HOST:PORT/v1 until Ctrl-C."""
    from pathlib import Path

    from evalpipe.engine.model.weights import BUILTIN_MODELS

    if model is not None and model not in BUILTIN_MODELS and not Path(model).exists():
        raise click.BadParameter(f"{model} does not exist (built-in models: {', '.join(BUILTIN_MODELS)})",
                                 param_hint="--model")
    if tokenizer is not None and not Path(tokenizer).exists():
        raise click.BadParameter(f"{tokenizer} does not exist", param_hint="--tokenizer")
    _check_speculation(speculative, block_size, drafter, simulate_acc_len)
    _check_accept_rule(speculative, simulate_acc_len, spec_accept_topk, spec_accept_threshold_single,
                       spec_accept_threshold_acc)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise click.BadParameter("CUDA is not available on this machine", param_hint="--device")

    if device == "cpu":
        import torch

        torch.set_num_threads(threads)

    import uvicorn

    from evalpipe.engine.model.config import DEFAULT_MODEL_NAME
    from evalpipe.server.app import create_app
    from evalpipe.server.state import ServerSettings, ServerState

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = _bind(host, port)
    port = sock.getsockname()[1]
    settings = ServerSettings(
        model=model, tokenizer=tokenizer, host=host, port=port, dtype=dtype, device=device, max_batch=max_batch,
        max_tokens_per_step=max_tokens_per_step, max_queue=max_queue, max_seq_len=max_seq_len, api_key=api_key, docs=docs,
        argv=["evalpipe", *sys.argv[1:]],
        speculative=speculative, block_size=block_size, drafter=drafter, simulate_acc_len=simulate_acc_len,
        spec_accept_topk=spec_accept_topk, spec_accept_threshold_single=spec_accept_threshold_single,
        spec_accept_threshold_acc=spec_accept_threshold_acc, fused=fused, cuda_graphs=cuda_graphs, wo_quant=wo_quant,
    )
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_ready(state: ServerState) -> None:
        url = f"http://{_display_host(host)}:{port}/v1"
        click.echo(f"evalpipe serve: ready at {url} (model {state.model_id}, {dtype} on {device}, "
                   f"{speculation_summary(state)}, loaded in {state.load_seconds:.1f}s)")
        sys.stdout.flush()

    def on_error(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    state = ServerState(settings, on_ready=on_ready, on_error=on_error)
    config = uvicorn.Config(create_app(state), log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=3, lifespan="on")
    server = uvicorn.Server(config)
    click.echo(f"evalpipe serve: loading {model or DEFAULT_MODEL_NAME} on http://{_display_host(host)}:{port} ...")
    # uvicorn re-raises the signal that stopped it once it has shut down; a SIGINT/SIGTERM is a clean stop here.
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        state.shutdown()
    if failure:
        raise click.ClickException(f"model failed to load: {failure[0]}")
    click.echo("evalpipe serve: stopped")


def _check_speculation(mode, block_size, drafter, simulate_acc_len) -> None:
    """Reject speculation flags that cannot work before anything loads (clear usage errors, no tracebacks)."""
    from pathlib import Path

    from evalpipe.engine.spec.drafters import parse_drafter_spec

    if mode == "off" and (drafter is not None or simulate_acc_len is not None):
        raise click.UsageError("--drafter and --simulate-acc-len need --speculative block")
    if drafter is not None:
        try:
            kind, arg = parse_drafter_spec(drafter)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--drafter") from None
        if kind == "model" and not Path(arg).exists():
            raise click.BadParameter(f"draft model {arg} does not exist", param_hint="--drafter")
    if simulate_acc_len is not None and not 1.0 <= simulate_acc_len <= block_size + 1:
        raise click.BadParameter(f"must be in [1, G+1] = [1, {block_size + 1}] for --block-size {block_size}, "
                                 f"got {simulate_acc_len}", param_hint="--simulate-acc-len")


def _check_accept_rule(mode, simulate_acc_len, topk, threshold_single, threshold_acc) -> None:
    """Reject acceptance-rule flags that cannot work, with the reason (the rule itself lives in AcceptRule)."""
    from evalpipe.engine.spec.accept import AcceptRule

    given = [f for f, v in (("--spec-accept-topk", topk), ("--spec-accept-threshold-single", threshold_single),
                            ("--spec-accept-threshold-acc", threshold_acc)) if v is not None]
    if not given:
        return
    if mode != "block":
        raise click.UsageError(f"{'/'.join(given)} need{'s' if len(given) == 1 else ''} --speculative block")
    try:
        rule = AcceptRule.from_flags(topk, threshold_single, threshold_acc)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    if simulate_acc_len is not None and rule.lossy:
        raise click.UsageError("--simulate-acc-len checks no draft at all, so an acceptance rule has nothing to decide")


def speculation_summary(state) -> str:
    """`speculation off`, or the mode with its block size, drafter, acceptance rule (LOSSY when it is) and simulated
    accept length as served."""
    spec = state.engine.decoder.describe() if state.engine is not None else {}
    if spec.get("mode", "off") == "off":
        return "speculation off"
    from evalpipe.engine.spec.decoder import accept_rule_from_settings

    parts = [f"speculation {spec['mode']}", f"G={spec.get('block_size', state.settings.block_size)}"]
    drafter = spec.get("drafter") or state.settings.drafter
    if drafter:
        parts.append(f"drafter {drafter}")
    parts.append(accept_rule_from_settings(state.settings).label())
    if spec.get("simulate_acc_len") is not None:
        parts.append(f"SIMULATED accept length {spec['simulate_acc_len']} (performance only)")
    return " ".join(parts)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _bind(host: str, port: int) -> socket.socket:
    """Bind before loading, so a busy port is reported at once (and --port 0 knows its port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say they are TCP, and
    # with Nagle on, a response's second write waits for the client's delayed ACK: +40 ms per keep-alive request
    # and per streamed event
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise click.ClickException(f"cannot bind {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def _display_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else (f"[{host}]" if ":" in host else host)


# `--engine sglang|vllm` and `--dry-run` go to evalpipe/launchers (issue 7); native command lines are unchanged.
from evalpipe.launchers.dispatch import with_engine_dispatch  # noqa: E402

command = with_engine_dispatch(command)
