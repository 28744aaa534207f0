"""`evalpipe bench --client-processes N`: each round's streams read by N worker processes instead of one.

One process reads a bounded number of streamed events per second (its CPU per event); workers raise that bound
on a host with cores to spare. Each worker (multiprocessing spawn) keeps one event loop and one aiohttp session for
the whole bench. Per round the parent sends every worker the bodies of its contiguous share of the slots, then a
start message to each (the barrier: no stream starts before every worker holds its bodies), and each worker answers
with its streams' results and its start and end times. perf_counter is the host's monotonic clock, the same in
every process, so the round's wall time is the last end minus the first start, as for one process.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Awaitable, Callable, Optional

from evalpipe.harness.client import streaming_client

StreamReader = Callable[[Any, str, dict], Awaitable[dict]]


class WorkerFailed(Exception):
    """A client worker raised or exited; the message says which and why."""


def shares(n_slots: int, n_workers: int) -> list[range]:
    """Contiguous slot ranges, sizes differing by at most one, in slot order."""
    base, extra = divmod(n_slots, n_workers)
    out, start = [], 0
    for i in range(n_workers):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def _worker_main(conn: Connection, read: StreamReader, api_key: Optional[str], timeout_s: float, connections: int):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it keeps the finished rounds, then stops us
    asyncio.run(_serve(conn, read, api_key, timeout_s, connections))


async def _serve(conn: Connection, read: StreamReader, api_key: Optional[str], timeout_s: float, connections: int):
    async with streaming_client(api_key, timeout_s, connections) as client:
        while True:
            try:
                job = conn.recv()  # blocking: nothing else runs in this loop between rounds
            except EOFError:
                return
            if job is None:
                return
            url, bodies = job
            conn.recv()  # the start message
            try:
                start = time.perf_counter()
                results = await asyncio.gather(*(read(client, url, b) for b in bodies))
                conn.send(("ok", results, start, time.perf_counter()))
            except Exception as exc:  # reported to the parent, which stops the bench with it
                conn.send(("error", type(exc).__name__, str(exc)))


class ClientWorkers:
    """N worker processes reading a round's streams; a context manager that stops them on the way out."""

    def __init__(self, n: int, read: StreamReader, api_key: Optional[str], timeout_s: float, concurrency: int):
        """`read(session, url, body)` reads one stream (bench.stream_request; a module-level function: the workers
        import it by name)."""
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs = []
        for i, share in enumerate(shares(concurrency, n)):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(child, read, api_key, timeout_s, len(share)), name=f"bench-client-{i}"
            )
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def __enter__(self) -> "ClientWorkers":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None:  # a failed or interrupted round: its other streams are not waited for
            for proc in self.procs:
                proc.terminate()
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join()

    async def round(self, url: str, bodies: list[dict]) -> tuple[list[dict], float]:
        """(results in slot order, wall seconds from the first stream's start to the last one's end)."""
        try:
            for conn, share in zip(self.conns, shares(len(bodies), len(self.conns))):
                conn.send((url, [bodies[i] for i in share]))
            for conn in self.conns:
                conn.send("start")
        except OSError:
            self._raise_exited()
        answers: dict[int, tuple] = {}
        while len(answers) < len(self.conns):
            waiting = [c for i, c in enumerate(self.conns) if i not in answers]
            # waited on in a thread, so that Ctrl-C (asyncio cancels the main task) is not held until the round ends
            for conn in await asyncio.to_thread(wait, waiting + [p.sentinel for p in self.procs]):
                if conn in waiting:
                    try:
                        answers[self.conns.index(conn)] = conn.recv()
                    except (EOFError, OSError):
                        self._raise_exited()
                elif not any(c.poll() for c in waiting):  # a worker exited, and no answer is waiting to be read
                    self._raise_exited()
        results: list[dict] = []
        for i in range(len(self.conns)):
            if answers[i][0] == "error":
                raise WorkerFailed(f"client worker {i}: {answers[i][1]}: {answers[i][2]}")
            results.extend(answers[i][1])
        return results, max(a[3] for a in answers.values()) - min(a[2] for a in answers.values())

    def _raise_exited(self) -> None:
        ended = wait([p.sentinel for p in self.procs], timeout=5)  # a closed pipe: its worker is on its way out
        for i, proc in enumerate(self.procs):
            if proc.sentinel in ended:
                proc.join(timeout=5)  # its sentinel closes a moment before it can be reaped
                raise WorkerFailed(f"client worker {i} exited with code {proc.exitcode}")
        raise WorkerFailed("a client worker's pipe closed")
