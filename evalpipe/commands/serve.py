"""`evalpipe serve`: a server behind an OpenAI-compatible API.

Served from this process: the native engine. The port opens first; the HTTP layer and the tokenizer run here and the
scheduler and model in an engine process it starts (health routes answer 503 while that loads); the ready line with
the URL is printed once weights are loaded. Ctrl-C or SIGTERM stops uvicorn, then the engine process, and the command
exits 0; if the engine process dies the server stops and the command exits 1. With `--engine sglang|vllm`,
`--dry-run` or any launcher flag the server starts through evalpipe/launchers instead. The flags are defined once,
in launchers/flags.py, and obey the rules of launchers/rules.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

import click

from evalpipe.engine.config import EngineConfig
from evalpipe.launchers import flags
from evalpipe.launchers.errors import LaunchConfigError
from evalpipe.launchers.rules import NATIVE_ACCEPT_RULES, check_acceptance, check_debug_faults, check_native

HELP = """Serve a model on http://HOST:PORT/v1 until Ctrl-C: the native engine (the built-in evalpipe-skills-dsv4 by
default) in this process, or SGLang / vLLM / the native engine through a launcher.

A launcher starts the server as a child process with a clean environment and a receipt; it is used for
--engine sglang|vllm, --dry-run, or any launcher flag (--tp/--ep/--dp, --draft-model, --spec-steps, --spec-topk,
--spec-draft-tokens, --keep-env, --set-env, --engine-python, --engine-command,
--ngram-min/--ngram-max, --ready-timeout, --receipt, --log-file).

\b
Speculation profiles (--speculative):
  native: off | block (--block-size, --drafter)
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
--dist-init-addr HOST:PORT) are passed to a launched engine unchanged; put them after `--` to be explicit.
The native engine's own flags are passed on to a launched native server as given.

--dry-run prints the command and environment and starts nothing (where SGLang or vLLM is not installed, it is
the only way to exercise those engines). vLLM's CPU build serves on a machine without GPUs: see docs/engines.md.
Each real launch writes a receipt JSON (argv, redacted environment, engine version, the server's own
settings report, /v1/models, GPUs, start/ready/stop times).
"""


@click.command("serve", help=HELP, context_settings=flags.CONTEXT)
@flags.serve_flags
def command(**params):
    given = flags.given(click.get_current_context())
    try:
        options = flags.options_from_params(params, given)
    except LaunchConfigError as exc:
        raise click.UsageError(str(exc)) from None
    if flags.needs_launcher(params, given):
        from evalpipe.launchers.launch import run

        run(
            options,
            dry_run=params["dry_run"],
            as_json=params["as_json"],
            ready_timeout=params["ready_timeout"],
            receipt=params["receipt"],
            log_file=params["log_file"],
        )
        return
    if params["extra_args"]:
        raise click.UsageError(
            f"no such option: {params['extra_args'][0]} (the native engine's flags are in "
            "--help; unknown flags go to a launched engine only)"
        )
    try:
        check_acceptance(options, "native", NATIVE_ACCEPT_RULES)
        check_native(options)
        check_debug_faults(params["debug_faults"], options)
    except LaunchConfigError as exc:
        raise click.UsageError(str(exc)) from None
    serve_native(params, options.native)


def serve_native(params: dict, config: EngineConfig) -> None:
    """The native engine in this process (built with `config`, the flags' EngineConfig), until Ctrl-C or SIGTERM."""
    device, host, log_level = config.device, params["host"], params["log_level"]
    sock = _bind(host, params["port"])  # before the imports below (uvicorn, FastAPI; torch is the engine process's)
    port = sock.getsockname()[1]
    if device == "cuda":  # bad input exits 2 before the engine starts; only --device cuda costs this process torch
        import torch

        if not torch.cuda.is_available():
            raise click.BadParameter("CUDA is not available on this machine", param_hint="--device")

    import uvicorn

    from evalpipe.engine.model.names import DEFAULT_MODEL_NAME
    from evalpipe.engine.process import exit_after_clean_stop
    from evalpipe.server.app import create_app
    from evalpipe.server.state import ServerSettings, ServerState

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keys = tuple(params["api_key"]) or tuple(k for k in [os.environ.get("EVALPIPE_API_KEY")] if k)
    settings = ServerSettings(
        engine=config,
        host=host,
        port=port,
        docs=params["docs"],
        argv=["evalpipe", *sys.argv[1:]],
        api_key=keys[0] if keys else None,
        more_api_keys=keys[1:],
    )
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_ready(state: ServerState) -> None:
        url = f"http://{_display_host(host)}:{port}/v1"
        click.echo(
            f"evalpipe serve: ready at {url} (model {state.model_id}, {config.dtype} on {device}, "
            f"{speculation_summary(state)}{', deterministic' if config.deterministic else ''}, "
            f"loaded in {state.load_seconds:.1f}s)"
        )
        if config.debug_faults:
            from evalpipe.engine.faults import DEBUG_FAULTS

            planted = "; ".join(f"{name} ({DEBUG_FAULTS[name]})" for name in config.debug_faults)
            click.echo(
                f"evalpipe serve: DEBUG FAULTS PLANTED: {planted}. This server is broken on purpose "
                "(evaluation of evaluations only)"
            )
        sys.stdout.flush()

    def on_error(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    state = ServerState(settings, on_ready=on_ready, on_error=on_error)
    http_config = uvicorn.Config(
        create_app(state),
        log_level=log_level,
        access_log=log_level == "debug",
        timeout_graceful_shutdown=3,
        lifespan="on",
    )
    server = uvicorn.Server(http_config)
    logging.getLogger("uvicorn.error").addFilter(_ForcedStopNote(server))
    click.echo(
        f"evalpipe serve: loading {config.model or DEFAULT_MODEL_NAME} on http://{_display_host(host)}:{port} ..."
    )
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
        raise click.ClickException(failure[0])
    click.echo("evalpipe serve: stopped")
    exit_after_clean_stop()


def speculation_summary(state) -> str:
    """`speculation off`, or the mode with its block size, drafter, acceptance rule (LOSSY when it is) and simulated
    accept length as served."""
    spec = state.speculative
    if spec.get("mode", "off") == "off":
        return "speculation off"
    from evalpipe.engine.spec.settings import accept_rule_from_settings

    parts = [f"speculation {spec['mode']}", f"G={spec.get('block_size', state.settings.engine.block_size)}"]
    drafter = spec.get("drafter") or state.settings.engine.drafter
    if drafter:
        parts.append(f"drafter {drafter}")
    parts.append(accept_rule_from_settings(state.settings.engine).label())
    if spec.get("simulate_acc_len") is not None:
        parts.append(f"SIMULATED accept length {spec['simulate_acc_len']} (performance only)")
    return " ".join(parts)


class _ForcedStopNote(logging.Filter):
    """A second Ctrl-C (or SIGTERM) makes uvicorn skip the app's shutdown and cancel its lifespan task, which it logs
    as a traceback; that cancellation is the forced stop asked for, so one line says so instead."""

    def __init__(self, server) -> None:
        super().__init__()
        self.server = server

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        # starlette reports the cancelled lifespan as its traceback's text (lifespan.shutdown.failed's message)
        cancelled = isinstance(exc, asyncio.CancelledError) or record.getMessage().rstrip().endswith("CancelledError")
        if self.server.force_exit and cancelled:
            record.msg, record.args, record.exc_info, record.exc_text = (
                "second stop signal: forced stop, the application's shutdown skipped",
                (),
                None,
                None,
            )
        return True


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
