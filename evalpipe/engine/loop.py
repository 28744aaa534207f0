"""The engine process's loop: the scheduler and the model, in a process of their own beside the HTTP server.

engine/process.py `main` builds the engine here (`build_engine`), reports it (`ready_message`) and runs `EngineLoop`,
which talks to the server over two ZeroMQ pipes with the messages of engine/ipc.py. The loop takes every message that
has arrived, applies it (new requests, aborts, calls), runs one `Engine.step()` and sends that step's events as one
`Step` message (with --burst-wait-ms, an engine that was idle first gathers the requests that keep arriving:
`_gather`). A step that released no event (a prompt chunk, tokens held back by the stream interval) sends nothing,
so neither process pays a message for it, except one empty `Step` every HEARTBEAT_S while such steps go on: the sign of
life /health_generate takes from a busy engine. An abort therefore reaches the engine before its next forward, and the
HTTP event loop and the model each have a GIL of their own. Grammars compile on a worker thread, so a slow schema does
not stall the steps of other requests. A step that leaves the device lost (engine/device_loss.py) ends the loop: it
sends `Lost`, then `run` raises DeviceLost and the process exits with EXIT_DEVICE_LOST.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import resource
import time
import traceback
from typing import Callable

import zmq

from evalpipe.engine import ipc
from evalpipe.engine.cache import PoolExhausted
from evalpipe.engine.config import GATHER_CAP, LONE_SHARE, EngineConfig
from evalpipe.engine.contracts import Decoder, Runner
from evalpipe.engine.device_loss import DeviceLost
from evalpipe.engine.engine import Engine
from evalpipe.engine.faults import faults_of
from evalpipe.engine.grammar import GrammarError
from evalpipe.engine.model.names import DEFAULT_MODEL_NAME
from evalpipe.engine.scheduler import QueueFull, Sequence, make_sequences
from evalpipe.engine.tokenizer import Tokenizer

log = logging.getLogger("evalpipe.engine")

IDLE_POLL_MS = 500  # how often an idle engine checks that its parent is alive
COMPILE_POLL_MS = 5  # while a grammar compiles on the worker thread
HEARTBEAT_S = 0.1  # the longest gap between two Step messages while the engine steps (/health_generate polls at 0.25 s)
STATS_INTERVAL_S = 10.0  # a busy engine logs its throughput this often (INFO: `evalpipe serve --log-level info`)


def build_engine(
    config: EngineConfig,
    build: Callable[[EngineConfig], tuple[Runner, Decoder | None]],
    tokenizer_factory: Callable[[EngineConfig], Tokenizer],
) -> Engine:
    if config.device == "cpu":
        import torch

        torch.set_num_threads(config.threads)
    tokenizer = tokenizer_factory(config)
    runner, decoder = build(config)
    vocab = runner.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
    return Engine(
        runner,
        tokenizer,
        max_batch=config.max_batch,
        max_tokens_per_step=config.max_tokens_per_step,
        max_queue=config.max_queue,
        decoder=decoder,
        exhausted=(PoolExhausted,),
        overlap=config.overlap_schedule == "on",
        prefill_delay_factor=config.prefill_delay_factor,
        stream_interval=config.stream_interval,
        keyed_sampling=config.deterministic,
        debug_faults=faults_of(config),
    )


def ready_message(config: EngineConfig, engine: Engine) -> ipc.Ready:
    runner, cfg = engine.runner, engine.runner.config
    bos = engine.tokenizer.bos_token_id
    bos = bos if bos is not None else cfg.bos_token_id or 0
    static = {
        "config": cfg.to_dict(),
        "runner": _safe(runner.describe),
        "speculative": dict(engine.decoder.describe()),
        "model_path": runner.model_path,
    }
    if runner.fused_sites is not None:
        static["fused_sites"] = runner.fused_sites
    return ipc.Ready(
        pid=os.getpid(),
        model_id=runner.model_name or config.model or DEFAULT_MODEL_NAME,
        max_seq_len=runner.max_seq_len,
        vocab_size=int(cfg.vocab_size),
        bos_token_id=bos,
        max_queue=engine.scheduler.max_queue,
        grammar_blocker=engine.grammar_blocker(),
        static_info=static,
    )


class EngineLoop:
    """Messages in, one step, one `Step` message out; until `Shutdown` or the parent is gone."""

    def __init__(
        self,
        engine: Engine,
        recv: zmq.Socket,
        send: zmq.Socket,
        parent: int,
        heartbeat_s: float = HEARTBEAT_S,
        burst_wait_ms: float = 0.0,
        lone_wait_ms: float | None = None,
    ):
        self.engine = engine
        self.heartbeat_s = heartbeat_s
        self.burst_wait_ms = burst_wait_ms
        self.lone_wait_ms = burst_wait_ms / LONE_SHARE if lone_wait_ms is None else lone_wait_ms
        self.sent_at = 0.0  # time.monotonic() of the last Step message
        self.recv = recv
        self.send = send
        self.parent = parent
        self.requests: dict[int, list[Sequence]] = {}  # rid -> its sequences, until all have finished
        self.remaining: dict[int, int] = {}
        self.events: list[tuple[int, ipc.SeqEvent]] = []  # the current step's (rid, SeqEvent)
        self.compiling: dict[concurrent.futures.Future, int] = {}  # compile future -> call id
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="evalpipe-grammar")
        self.poller = zmq.Poller()
        self.poller.register(recv, zmq.POLLIN)
        self.window = StepWindow(engine)

    def run(self) -> None:
        lost = False
        try:
            while True:
                if not self.engine.busy:
                    self.window.idle()
                    timeout = COMPILE_POLL_MS if self.compiling else IDLE_POLL_MS
                    if not self.poller.poll(timeout):
                        self._reply_compiled()
                        if os.getppid() != self.parent:
                            log.warning("the server process is gone; the engine exits")
                            return
                        continue
                was_idle = not self.engine.busy
                if not self._take_messages():
                    return
                if was_idle and self.burst_wait_ms and self.engine.busy and not self._gather():
                    return
                self._reply_compiled()
                if self.engine.busy:
                    self._step()
        except DeviceLost as exc:
            lost = True
            self._lost(exc)
            raise
        finally:
            self.compiler.shutdown(wait=False, cancel_futures=True)
            if not lost:  # after a lost device the server fails what was in flight
                self.engine.fail_all("abort")

    def _lost(self, exc: DeviceLost) -> None:
        """Tell the server, which fails every request in flight as `engine_dead` and stops. The sequences are not
        finished here: that gives back their slots, which may touch the lost device."""
        log.error("the engine's device is lost (%s); the engine exits", exc)
        if self.events:
            self.send.send_pyobj(ipc.Step(self.events))
        self.send.send_pyobj(ipc.Lost(str(exc)))

    def _step(self) -> None:
        self.window.begin()
        prompt_steps = self.engine.stats["prefill_steps"]
        started = time.perf_counter()
        try:
            advanced = self.engine.step()
        except DeviceLost:
            raise
        except Exception as exc:  # a bug outside the forward: fail what is in flight, keep the engine alive
            log.error("engine loop error:\n%s", traceback.format_exc())
            self.engine.check_device()
            self.engine.fail_all("error", error=f"{type(exc).__name__}: {exc}")
            advanced = 1
        self.window.stepped(time.perf_counter() - started, self.engine.stats["prefill_steps"] > prompt_steps)
        now = time.monotonic()
        if self.events or (advanced and now - self.sent_at >= self.heartbeat_s):
            events, self.events = self.events, []
            self.send.send_pyobj(ipc.Step(events))
            self.sent_at = now
        self.window.maybe_log()

    def _gather(self) -> bool:
        """--burst-wait-ms: requests have just reached an idle engine; take those that follow each within
        burst_wait_ms of the last, for at most GATHER_CAP x burst_wait_ms, so that a burst starts as one prompt step
        (on a GPU a small prompt step costs nearly as much as a large one). While the engine holds a lone request
        the wait is lone_wait_ms (burst_wait_ms / LONE_SHARE): a client that sends one request at a time pays that,
        not the whole wait. False on Shutdown."""
        end = time.monotonic() + GATHER_CAP * self.burst_wait_ms / 1e3
        while (left_ms := (end - time.monotonic()) * 1e3) > 0:
            wait_ms = self.lone_wait_ms if len(self.requests) <= 1 else self.burst_wait_ms
            if not self.poller.poll(max(1, math.ceil(min(wait_ms, left_ms)))):
                return True
            if not self._take_messages():
                return False
        return True

    # -- messages ----------------------------------------------------------------------------------
    def _take_messages(self) -> bool:
        """Apply every message waiting; False on Shutdown."""
        while True:
            try:
                msg = self.recv.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if isinstance(msg, ipc.Submit):
                self._submit(msg)
            elif isinstance(msg, ipc.Abort):
                for rid in msg.rids:
                    seqs = self.requests.pop(rid, None)
                    self.remaining.pop(rid, None)
                    if seqs:
                        self.engine.abort(seqs)
            elif isinstance(msg, ipc.Call):
                self._call(msg)
            elif isinstance(msg, ipc.Shutdown):
                return False

    def _submit(self, msg: ipc.Submit) -> None:
        def on_event(ev, rid=msg.rid) -> None:
            self.events.append((rid, ev))
            if ev.finish_reason is not None and rid in self.remaining:
                self.remaining[rid] -= 1
                if not self.remaining[rid]:
                    del self.remaining[rid], self.requests[rid]

        seqs: list[Sequence] = []
        for i, (prompt, params) in enumerate(zip(msg.prompts, msg.params)):
            seqs += make_sequences(prompt, params, msg.n, on_event, first_index=i * msg.n)
        try:
            self.engine.submit(seqs)
        except QueueFull as exc:
            self.send.send_pyobj(ipc.Reply(msg.call_id, error=str(exc), error_kind="queue_full"))
            return
        except GrammarError as exc:
            self.send.send_pyobj(ipc.Reply(msg.call_id, error=str(exc), error_kind="grammar"))
            return
        self.requests[msg.rid] = seqs
        self.remaining[msg.rid] = len(seqs)
        self.send.send_pyobj(ipc.Reply(msg.call_id, result=True))

    def _call(self, msg: ipc.Call) -> None:
        if msg.method == "compile":
            self.compiling[self.compiler.submit(self.engine.grammars.compile, *msg.args)] = msg.call_id
            return
        try:
            if msg.method == "flush_cache":
                result = self.engine.flush_cache()
            elif msg.method == "describe":
                result = self._describe()
            else:
                raise ValueError(f"unknown engine call {msg.method!r}")
        except Exception as exc:  # reported to the caller, never fatal to the loop
            self.send.send_pyobj(ipc.Reply(msg.call_id, error=f"{type(exc).__name__}: {exc}"))
            return
        self.send.send_pyobj(ipc.Reply(msg.call_id, result=result))

    def _reply_compiled(self) -> None:
        for future in [f for f in self.compiling if f.done()]:
            call_id = self.compiling.pop(future)
            exc = future.exception()
            if exc is None:
                self.send.send_pyobj(ipc.Reply(call_id, result=True))
            else:
                kind = "grammar" if isinstance(exc, GrammarError) else None
                self.send.send_pyobj(
                    ipc.Reply(call_id, error=str(exc) if kind else f"{type(exc).__name__}: {exc}", error_kind=kind)
                )

    def _describe(self) -> dict:
        """The moving parts of /get_server_info, as of the last step."""
        runner = self.engine.runner
        out: dict = {
            "engine": self.engine.describe(),
            "runner": _safe(runner.describe),
            "speculative": dict(self.engine.decoder.describe()),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "last_step_age_s": (time.monotonic() - self.engine.last_step_at if self.engine.last_step_at else None),
        }
        if runner.fused_sites is not None:
            from evalpipe.engine.model.fused_sites import site_counts

            out["fused_site_calls"] = site_counts()
        return out


class StepWindow:
    """Throughput of the last STATS_INTERVAL_S of steps, logged at INFO (as SGLang's decode-batch line): a slow
    server shows whether the time goes to `Engine.step` (the model and the engine's bookkeeping) or to the loop
    around it (messages in, events out to the HTTP process), and `Engine.step`'s mean time over decode-only steps
    and over steps that fed prompt chunks, each apart."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.start: float | None = None  # None: idle, the window opens at the next step

    def _reset(self, now: float | None) -> None:
        self.start, self.steps, self.step_s, self.prompt_step_s = now, 0, 0.0, 0.0
        self.base = dict(self.engine.stats)  # the engine's counters when the window opened

    def begin(self) -> None:
        """Before a step: open the window if the engine was idle (its counters as they are before this step)."""
        if self.start is None:
            self._reset(time.monotonic())

    def stepped(self, seconds: float, fed_prompt: bool) -> None:
        """One `Engine.step` took `seconds`; `fed_prompt`: it fed prompt chunks (timed apart from decode-only steps)."""
        self.steps += 1
        self.step_s += seconds
        if fed_prompt:
            self.prompt_step_s += seconds

    def idle(self) -> None:
        """The engine ran out of work: log the partial window, and do not count the idle time."""
        if self.start is not None:
            self.maybe_log(force=True)
            self.start = None

    def maybe_log(self, force: bool = False) -> None:
        if self.start is None:
            return
        now = time.monotonic()
        wall = now - self.start
        if wall < STATS_INTERVAL_S and not force:
            return
        if self.steps and wall > 0 and log.isEnabledFor(logging.INFO):
            grew = {k: v - self.base.get(k, 0) for k, v in self.engine.stats.items()}
            chunked, prefilled = grew["prefill_steps"], grew["prefilled_tokens"]
            log.info(
                "engine: %d running, %d waiting; last %.1f s: %d steps (%d overlapped, %d with prompt chunks, "
                "%.0f prompt rows each), %.0f generated tok/s, %.0f prefilled tok/s, %.2f ms per loop of which "
                "Engine.step %.2f ms; Engine.step %.2f ms without prompt chunks, %.1f ms with them",
                self.engine.scheduler.num_running,
                self.engine.scheduler.num_waiting,
                wall,
                self.steps,
                grew["overlapped_steps"],
                chunked,
                prefilled / chunked if chunked else 0.0,
                grew["generated_tokens"] / wall,
                prefilled / wall,
                wall / self.steps * 1e3,
                self.step_s / self.steps * 1e3,
                (self.step_s - self.prompt_step_s) / (self.steps - chunked) * 1e3 if self.steps > chunked else 0.0,
                self.prompt_step_s / chunked * 1e3 if chunked else 0.0,
            )
        self._reset(now)


def _safe(fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as exc:  # introspection must never break the engine
        return {"error": f"{type(exc).__name__}: {exc}"}
