"""The server's side of the engine process: spawn it, submit and abort requests, route its step events to jobs.

One reader task on the HTTP event loop takes the engine's messages (engine/ipc.py): a `Step` puts each
(rid, SeqEvent) on its job's asyncio queue, a `Reply` resolves the awaiting call. Sends happen on the event loop
only (ZeroMQ sockets are not thread-safe). When the process exits (or says with `Lost` that its device is lost,
just before it exits), every waiting call fails with `EngineDead`
and every open job's queue gets `ENGINE_DEAD`, so no request hangs on a dead engine; `on_dead` lets the server
stop. The process is spawned (never forked: the server has threads) and told to stop with `Shutdown`, then
terminated and killed if it does not go.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
from typing import Any, Callable

import zmq
import zmq.asyncio

from evalpipe.engine import ipc, process
from evalpipe.engine.config import EngineConfig

log = logging.getLogger("evalpipe.server")

ENGINE_DEAD = object()  # put on every open job's queue when the engine process exits
READ_POLL_MS = 250  # how often the reader checks the process while no message comes
CALL_TIMEOUT_S = 30.0


class EngineDead(RuntimeError):
    """The engine process has exited; the server answers 503."""


class EngineLoadError(RuntimeError):
    """The engine process could not build the model (its message is the reason)."""


class EngineCallError(RuntimeError):
    def __init__(self, message: str, kind: str | None):
        super().__init__(message)
        self.kind = kind  # "queue_full" | "grammar" | None


class EngineClient:
    def __init__(
        self,
        settings: EngineConfig,
        build: Callable,
        tokenizer_factory: Callable,
        on_dead: Callable[[str], None] | None = None,
    ):
        self.settings = settings
        self._build = build
        self._tokenizer_factory = tokenizer_factory
        self._on_dead = on_dead
        self.info: ipc.Ready | None = None
        self.dead: str | None = None  # why the process is gone
        self.last_step_at = 0.0  # time.monotonic() when the last Step message arrived
        self._ids = itertools.count(1)
        self._jobs: dict[int, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._ready: asyncio.Future | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._dir: str | None = None
        self._reader: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> ipc.Ready:
        """Spawn the engine process and wait until it has built the model; raises EngineLoadError."""
        loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="evalpipe-engine-")
        inbox, outbox = f"ipc://{self._dir}/requests", f"ipc://{self._dir}/outputs"
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.bind(inbox)
        self._async_ctx = zmq.asyncio.Context()
        self._pull = self._async_ctx.socket(zmq.PULL)
        self._pull.bind(outbox)
        self._ready = loop.create_future()
        spawn = multiprocessing.get_context("spawn")
        self._proc = spawn.Process(
            target=process.main,
            name="evalpipe-engine",
            daemon=True,
            args=(
                self.settings,
                self._build,
                self._tokenizer_factory,
                inbox,
                outbox,
                logging.getLogger().getEffectiveLevel(),
            ),
        )
        self._proc.start()
        self._reader = loop.create_task(self._read())
        self.info = await self._ready
        return self.info

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine process (Shutdown, then SIGTERM, then SIGKILL) and release the sockets."""
        if self._reader is not None:
            self._reader.cancel()
        proc = self._proc
        if proc is not None and proc.is_alive():
            try:
                self._push.send_pyobj(ipc.Shutdown(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            proc.join(timeout)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        if self._dir is not None:
            for name in ("_push", "_pull"):
                sock = getattr(self, name, None)
                if sock is not None:
                    sock.close(linger=0)
            for name in ("_sync_ctx", "_async_ctx"):
                ctx = getattr(self, name, None)
                if ctx is not None:
                    ctx.term()
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    # -- requests --------------------------------------------------------------------------------------
    async def submit(self, prompts: list[list[int]], params: list[Any], n: int) -> tuple[int, asyncio.Queue]:
        """Queue one request's sequences; returns its rid and the queue its SeqEvents arrive on. Raises
        EngineCallError("queue_full") when the engine's queue cannot take them, EngineDead when it is gone."""
        rid = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._jobs[rid] = queue
        try:
            await self._request(lambda call_id: ipc.Submit(call_id, rid, prompts, params, n))
        except BaseException:
            self._jobs.pop(rid, None)
            raise
        return rid, queue

    def abort(self, rid: int) -> None:
        """Abort a request's unfinished sequences before the engine's next forward; its queue is closed."""
        self._jobs.pop(rid, None)
        if self.dead is None:
            try:
                self._push.send_pyobj(ipc.Abort([rid]), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def release(self, rid: int) -> None:
        """Forget a request whose sequences have all finished."""
        self._jobs.pop(rid, None)

    async def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run `method` in the engine process between two steps ("compile", "flush_cache", "describe")."""
        return await self._request(lambda call_id: ipc.Call(call_id, method, args), timeout)

    async def _request(self, make: Callable[[int], Any], timeout: float | None = None) -> Any:
        if self.dead is not None:
            raise EngineDead(self.dead)
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._push.send_pyobj(make(call_id))
        try:
            reply: ipc.Reply = await asyncio.wait_for(asyncio.shield(future), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the engine did not answer within {timeout:.0f}s") from None
        finally:
            self._calls.pop(call_id, None)
        if reply.error is not None:
            raise EngineCallError(reply.error, reply.error_kind)
        return reply.result

    # -- the reader -------------------------------------------------------------------------------------
    async def _read(self) -> None:
        try:
            while True:
                if not await self._pull.poll(READ_POLL_MS):
                    if not self._proc.is_alive():
                        self._died(f"the engine process exited with code {self._proc.exitcode}")
                        return
                    continue
                while self._pull.get(zmq.EVENTS) & zmq.POLLIN:  # every message already here, one poll
                    self._dispatch(await self._pull.recv_pyobj())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here would leave every request hanging: fail them instead
            log.exception("engine reader failed")
            self._died(f"the engine connection failed: {type(exc).__name__}: {exc}")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ipc.Step):
            self.last_step_at = time.monotonic()
            jobs = self._jobs
            for rid, event in msg.events:
                queue = jobs.get(rid)
                if queue is not None:
                    queue.put_nowait(event)
        elif isinstance(msg, ipc.Reply):
            future = self._calls.get(msg.call_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, ipc.Ready):
            if not self._ready.done():
                self._ready.set_result(msg)
        elif isinstance(msg, ipc.LoadFailed):
            if not self._ready.done():
                self._ready.set_exception(EngineLoadError(msg.error))
        elif isinstance(msg, ipc.Lost):
            self._died(f"its device is lost: {msg.error}")

    def _died(self, reason: str) -> None:
        if self.dead is not None:  # told by a Lost message first, then seen exiting
            return
        self.dead = reason
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineLoadError(reason))
            return
        log.error("%s", reason)
        for future in self._calls.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        for queue in self._jobs.values():
            queue.put_nowait(ENGINE_DEAD)
        if self._on_dead is not None:
            self._on_dead(reason)
