"""What `evalpipe serve` adds per decode step over the in-process `Engine`: the engine loop's host time outside the
model, split by part, and the HTTP process's CPU, at C64 and C1.

    PYTHONPATH=. python -m benchmarks.serving.server_host_cost [--concurrency 64,1] [--new-tokens 128] [--rounds 3]
        [--bare-client] [--baseline DIR]   # DIR: another tree, e.g. `mkdir DIR && git archive COMMIT | tar -x -C DIR`
    PYTHONPATH=. python -m benchmarks.serving.server_host_cost --smoke       # under half a minute (tests/benchmarks)

On the H200 (the v4-top2 checkpoint of benchmarks/serving/gpu_serving.py, random bf16 weights, written as
benchmarks/serving/gpu_real_job.py writes it; CUDA graphs and the overlap schedule, as `evalpipe serve` runs; the
HTTP stack's wheels installed from .whl/ as benchmarks/README.md's "On the GPU machine" says; prompts and
outputs as gpu_real_job's `evalpipe bench` arms; a --baseline tree travels in a carried folder):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. python -m benchmarks.serving.server_host_cost --device cuda \
        --prompt-len 128 --new-tokens 256 --bare-client --out $OUT

Arms, per concurrency C (C prompts of --prompt-len random ids, greedy, ignore_eos, --new-tokens each):
- `in-process`: the engine the server's engine process builds (engine/loop.py `build_engine`), stepped in this
  process until every sequence finishes, with no listener (as gpu_real_job's engine stage);
- `served`: `evalpipe serve` with the same engine settings, C streamed /v1/completions requests shaped as
  `evalpipe bench` sends them (return_token_ids, continuous usage), the client in this process.
Each arm runs twice: clean (nothing wrapped: the step wall and tok/s) and instrumented (the parts).

The parts are timed by wrapping the engine's methods from here, nothing in the package: `Ledger` keeps each wrapped
call's exclusive time (its own time less that of the wrapped calls inside it) and files every step under its kind
(decode or prompt) and its number of decode rows; the table shows the decode steps with exactly C rows. The
served engine process is instrumented the same way: the server runs as `python -m <this module> --serve-child`, so
the engine process that multiprocessing spawns from it imports this module as `__mp_main__` (how spawn rebuilds
the parent's main module), and with HOST_COST_LEDGER set in its environment it installs the wrappers and writes its
ledger to that file each time it goes idle. The CPU of the HTTP process, of the engine process and of this
process's main thread (the client's event loop) is read from /proc/<pid>/task/*/schedstat every few ms, and taken
over the steady window of a round: from the last request's first token to the first request's last token; steps in
that window = its tokens / C. The instrumented server's HTTP process is also profiled over the measured rounds
(cProfile, started by SIGUSR1 and written by SIGUSR2; each function's own time summed by HTTP_GROUPS, the event
loop's wait left out). With --baseline, that tree's server runs beside this tree's and the two take turns round by
round.

Parts: schedule (Scheduler.schedule), model (runner forward / decode_async / settle: on the GPU with the overlap
schedule, launching the next step and waiting for the previous one's tokens), sample (Engine._commit_tokens, the
argmax read), emit (Engine._emit: stop checks, text deltas, the SeqEvent), detokenize (the detokenizer's push and
flush), finish (Engine._finish), hand-off (engine/output.py `deliver`: stream-interval merging and the listener), step
other (the rest of Engine.step), pickle and zmq send (the Step message), messages in (EngineLoop._take_messages), and
unattributed: the step's wall less all of these (the loop, its poll, the wrappers themselves).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
LEDGER_ENV = "HOST_COST_LEDGER"  # set in a served engine process's environment: install the ledger, write it there
PROFILE_ENV = "HOST_COST_HTTP_PROFILE"  # set for --serve-child: SIGUSR1 starts cProfile, SIGUSR2 writes it here
# the HTTP process's profile, grouped by where a function lives (first match of its file or built-in name)
HTTP_GROUPS = (
    (
        "idle",
        ("<method 'poll' of 'select.epoll' objects>", "<method 'select' of 'select.epoll' objects>", "run_forever"),
    ),
    ("engine messages in (zmq, unpickle)", ("engine_client.py", "/zmq/", "zmq", "pickle", "_pickle")),
    ("events (queue, merge)", ("server/jobs.py", "engine/ipc.py", "asyncio/queues.py", "dataclasses")),
    (
        "SSE chunks (responses, JSON)",
        ("server/responses.py", "server/errors.py", "tool_calls.py", "/json/", "json", "dumps"),
    ),
    (
        "HTTP write (starlette, uvicorn, h11)",
        ("starlette/", "uvicorn/", "h11/", "fastapi/", "httptools", "anyio/", "selector_events.py", "send"),
    ),
    ("event loop (asyncio)", ("asyncio/", "selectors.py", "poll", "select")),
)
UNSET = object()
SLOW_SEND_S = 2e-4
PARTS = (
    "schedule",
    "model",
    "sample",
    "emit",
    "detokenize",
    "finish",
    "hand_off",
    "step_other",
    "pickle",
    "zmq_send",
    "messages_in",
)
LABELS = {
    "schedule": "schedule",
    "model": "model (forward; GPU: launch + wait)",
    "sample": "sample (commit tokens)",
    "emit": "emit (stops, deltas, SeqEvent)",
    "detokenize": "detokenize",
    "finish": "finish",
    "hand_off": "hand-off (stream interval, listener)",
    "step_other": "Engine.step other",
    "pickle": "pickle Step",
    "zmq_send": "zmq send",
    "messages_in": "messages in (recv, apply)",
    "unattributed": "unattributed (loop, poll, wrappers)",
}


class Ledger:
    """Exclusive seconds per part, summed per step and filed under "kind:rows" (kind: decode or prompt)."""

    def __init__(self, path: str | None = None):
        self.path = path
        self.children: list[float] = []  # per open wrapped call: the time of the wrapped calls inside it so far
        self.current: dict[str, float] = defaultdict(float)
        self.started: float | None = None  # perf_counter at the open step's Engine.step entry
        self.kind: str | None = None  # the open step's plan: "decode:<rows>", "prompt:<rows>", or None (empty)
        self.buckets: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.dumped = 0
        self.undo: list[tuple[object, str, object]] = []

    def timed(self, part: str, fn):
        children, current, clock = self.children, self.current, time.perf_counter

        def wrapper(*args, **kwargs):
            t0 = clock()
            children.append(0.0)
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - t0
                current[part] += elapsed - children.pop()
                if children:
                    children[-1] += elapsed

        return wrapper

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)
        self.undo.append((owner, name, owner.__dict__.get(name, UNSET)))  # UNSET: inherited, or a bound method
        setattr(owner, name, self.timed(part, original))

    def begin_step(self) -> None:
        now = time.perf_counter()
        self.close(now)
        self.started, self.kind = now, None

    def close(self, now: float | None = None) -> None:
        """End the open step at `now`: its wall and parts go to its bucket (a step that planned nothing is dropped)."""
        if self.started is not None and self.kind is not None:
            bucket = self.buckets[self.kind]
            bucket["steps"] += 1
            bucket["wall"] += (now or time.perf_counter()) - self.started
            for part, seconds in self.current.items():
                bucket[part] += seconds
        self.current.clear()
        self.started = None

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {kind: dict(bucket) for kind, bucket in self.buckets.items()}

    def dump(self) -> None:
        """Write the snapshot where the orchestrator reads it (atomically), when there is something new."""
        steps = sum(b["steps"] for b in self.buckets.values())
        if self.path is None or steps == self.dumped:
            return
        self.dumped = steps
        tmp = self.path + ".tmp"
        Path(tmp).write_text(json.dumps(self.snapshot()))
        os.replace(tmp, self.path)

    def uninstall(self) -> None:
        for owner, name, original in reversed(self.undo):
            if original is UNSET:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self.undo.clear()


def install(ledger: Ledger, engine=None) -> None:
    """Wrap the engine's methods (classes, `engine`'s runner and each new Engine's) so `ledger` times every part."""
    import zmq

    from evalpipe.engine import engine as engine_mod
    from evalpipe.engine import output as output_mod
    from evalpipe.engine import scheduler as scheduler_mod
    from evalpipe.engine import tokenizer as tokenizer_mod
    from evalpipe.engine.loop import EngineLoop, StepWindow

    Engine = engine_mod.Engine
    step, schedule, init = Engine.step, scheduler_mod.Scheduler.schedule, Engine.__init__
    timed_step = ledger.timed("step_other", step)

    def step_wrapper(self):
        ledger.begin_step()
        return timed_step(self)

    def schedule_wrapper(self, *args, **kwargs):
        plan = schedule(self, *args, **kwargs)
        if not plan.empty:
            ledger.kind = f"{'prompt' if plan.prefills else 'decode'}:{len(plan.decodes)}"
        return plan

    def wrap_runner(runner) -> None:
        for name in ("forward", "decode_async", "settle"):
            if hasattr(runner, name):
                ledger.wrap(runner, name, "model")

    def init_wrapper(self, *args, **kwargs):
        init(self, *args, **kwargs)
        wrap_runner(self.runner)

    if engine is not None:
        wrap_runner(engine.runner)

    ledger.undo += [(Engine, "step", step), (scheduler_mod.Scheduler, "schedule", schedule), (Engine, "__init__", init)]
    Engine.step, Engine.__init__ = step_wrapper, init_wrapper
    scheduler_mod.Scheduler.schedule = ledger.timed("schedule", schedule_wrapper)
    for name, part in (("_commit_tokens", "sample"), ("_emit", "emit"), ("_finish", "finish")):
        ledger.wrap(Engine, name, part)
    ledger.wrap(output_mod, "deliver", "hand_off")  # Engine._emit and _finish call it through the module
    for cls in (tokenizer_mod.ByteDetokenizer, tokenizer_mod.HFDetokenizer):
        ledger.wrap(cls, "push", "detokenize")
        ledger.wrap(cls, "flush", "detokenize")
    ledger.wrap(EngineLoop, "_take_messages", "messages_in")
    pickled, sent = ledger.timed("pickle", pickle.dumps), ledger.timed("zmq_send", zmq.Socket.send)

    def send_pyobj(self, obj, flags=0, protocol=pickle.DEFAULT_PROTOCOL, **kwargs):  # zmq's send_pyobj, timed
        data = pickled(obj, protocol)
        t0 = time.perf_counter()
        try:
            return sent(self, data, flags=flags, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            if elapsed > SLOW_SEND_S:  # no copy takes this long: the sender lost its CPU to the thread it woke
                ledger.current["zmq_send_slow"] += elapsed

    ledger.undo.append((zmq.Socket, "send_pyobj", zmq.Socket.send_pyobj))
    zmq.Socket.send_pyobj = send_pyobj
    idle = StepWindow.idle

    def idle_wrapper(self):  # the loop ran out of work: the last step ends here, and the ledger is written
        ledger.close()
        ledger.dump()
        return idle(self)

    ledger.undo.append((StepWindow, "idle", idle))
    StepWindow.idle = idle_wrapper


if __name__ == "__mp_main__" and os.environ.get(LEDGER_ENV):  # a served engine process, spawned by --serve-child
    install(Ledger(os.environ[LEDGER_ENV]))


# ---- measurements -------------------------------------------------------------------------------------------------


def diff(after: dict, before: dict) -> dict[str, dict[str, float]]:
    out = {}
    for kind, bucket in after.items():
        base = before.get(kind, {})
        grew = {k: v - base.get(k, 0.0) for k, v in bucket.items()}
        if grew.get("steps", 0) > 0:
            out[kind] = grew
    return out


def per_step_us(buckets: dict, rows: int) -> dict[str, float] | None:
    """µs per decode step with exactly `rows` decode rows: every part, `wall`, and `unattributed`."""
    b = buckets.get(f"decode:{rows}")
    if not b:
        return None
    n = b["steps"]
    out = {part: b.get(part, 0.0) / n * 1e6 for part in PARTS}
    out["wall"] = b["wall"] / n * 1e6
    out["unattributed"] = out["wall"] - sum(out[p] for p in PARTS)
    out["steps"] = n
    out["zmq_send_slow"] = b.get("zmq_send_slow", 0.0) / n * 1e6
    return out


def prompts_for(concurrency: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(16, min(vocab, 256), size=(concurrency, length)).tolist()


def engine_config(args):
    from evalpipe.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        max_batch=64,
        prefix_cache="off",
        stream_interval=args.stream_interval,
    )


def build(args):
    from evalpipe.engine.loop import build_engine
    from evalpipe.server.state import build_in_engine_process, default_tokenizer_factory

    return build_engine(engine_config(args), build_in_engine_process, default_tokenizer_factory)


def in_process(args, engine, concurrency: int, ledger: Ledger | None) -> dict:
    """The server's engine, built as its engine process builds it, stepped here: median step wall of the rounds'
    decode steps with all `concurrency` rows, tok/s, and (with `ledger`) the parts."""
    from evalpipe.engine.sampling_params import SamplingParams
    from evalpipe.engine.scheduler import Sequence

    if ledger is not None:
        install(ledger, engine)
    try:
        prompts = prompts_for(concurrency, args.prompt_len, engine.runner.config.vocab_size, args.seed)
        walls: list[float] = []
        before: dict = {}
        for rnd in range(args.rounds + 1):  # round 0 warms up
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            seqs = [Sequence(prompt=p, params=params) for p in prompts]
            engine.submit(seqs)
            if rnd == 1 and ledger is not None:
                before = ledger.snapshot()
            while engine.busy:
                decoding = len(engine.scheduler.running) == concurrency and not engine.scheduler.waiting
                t0 = time.perf_counter()
                engine.step()
                if rnd and decoding and not any(s.prefilling for s in seqs):
                    walls.append(time.perf_counter() - t0)
            if ledger is not None:
                ledger.close()
        parts = per_step_us(diff(ledger.snapshot(), before), concurrency) if ledger else None
        wall_us = statistics.median(walls) * 1e6
        return {"wall_us": wall_us, "tok_s": concurrency / wall_us * 1e6, "parts": parts}
    finally:
        if ledger is not None:
            ledger.uninstall()


class ServedChild:
    """`evalpipe serve` run as `python -m <this module> --serve-child ARGS` (see the module docstring)."""

    def __init__(
        self, serve_args: list[str], ledger_path: str | None, profile_path: str | None = None, root: Path = REPO
    ):
        from tests.support.server_harness import ServerProcess, free_port

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="host-cost-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        env.pop(LEDGER_ENV, None)
        env.pop(PROFILE_ENV, None)
        if ledger_path is not None:
            env[LEDGER_ENV] = ledger_path
        if profile_path is not None:
            env[PROFILE_ENV] = profile_path
        self.ledger_path, self.profile_path = ledger_path, profile_path
        cmd = [sys.executable, "-m", __spec__.name, "--serve-child", "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=root)
        self.harness = ServerProcess.__new__(ServerProcess)  # its ready wait, stop and engine pid, on this process
        self.harness.port, self.harness.base, self.harness.log, self.harness.proc = (
            self.port,
            self.base,
            self.log,
            self.proc,
        )
        self.harness._wait_ready()
        self.engine_pid = self.harness.engine_pid()

    def profile(self, on: bool, steps: int = 1) -> dict | None:
        """Start (SIGUSR1) or stop (SIGUSR2) the HTTP process's profile; on stop, its µs per step by group."""
        if self.profile_path is None:
            return None
        with contextlib.suppress(OSError):
            os.unlink(self.profile_path)
        os.kill(self.proc.pid, signal.SIGUSR1 if on else signal.SIGUSR2)
        if on:
            return None
        deadline = time.monotonic() + 30
        while not os.path.exists(self.profile_path):
            if time.monotonic() > deadline:
                raise RuntimeError("the HTTP process wrote no profile")
            time.sleep(0.05)
        groups = json.loads(Path(self.profile_path).read_text())
        return {group: seconds / steps * 1e6 for group, seconds in groups.items()}

    def stop(self) -> None:
        self.harness.stop()
        for path in (self.log.name, self.ledger_path, self.profile_path):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """CPU time of every thread of `pid` (or of its thread `thread` alone) so far (schedstat: nanoseconds, unlike
    stat's 10 ms ticks)."""
    total = 0
    for task in [thread] if thread is not None else os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


class CpuSampler:
    """(perf_counter, CPU seconds of each pid, and of this process's main thread: the client's event loop, not the
    sampler) every `period` seconds on a thread, interpolated on demand."""

    def __init__(self, pids: list[int], period: float = 0.005):
        self.pids, self.period = pids, period
        self.me = os.getpid()
        self.samples: list[tuple[float, list[float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            cpu = [cpu_seconds(p) for p in self.pids] + [cpu_seconds(self.me, thread=self.me)]
            self.samples.append((time.perf_counter(), cpu))
            self._stop.wait(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, t: float) -> list[float]:
        before = [s for s in self.samples if s[0] <= t][-1]
        after = next((s for s in self.samples if s[0] >= t), before)
        if after[0] == before[0]:
            return list(before[1])
        w = (t - before[0]) / (after[0] - before[0])
        return [a + w * (b - a) for a, b in zip(before[1], after[1])]


async def stream_round(base: str, model: str, prompts: list[list[int]], new_tokens: int) -> list[tuple[float, list]]:
    """C streamed requests at once, as `evalpipe bench` sends them; per request (send time, [(rel time, tokens)])."""
    from evalpipe.harness.bench import stream_request
    from evalpipe.harness.client import streaming_client

    async with streaming_client(None, 600, len(prompts)) as client:

        async def one(prompt):
            sent = time.perf_counter()
            out = await stream_request(client, base + "/v1/completions", request_body(model, prompt, new_tokens))
            if out["error"] or out["completion_tokens"] != new_tokens:
                raise RuntimeError(f"request failed: {out['error'] or out['completion_tokens']}")
            return sent, out["events"]

        return await asyncio.gather(*(one(p) for p in prompts))


def request_body(model: str, prompt: list[int], new_tokens: int) -> dict:
    """The streamed completion `evalpipe bench` sends (evalpipe/harness/bench.py)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def bare_stream_round(
    base: str, model: str, prompts: list[list[int]], new_tokens: int
) -> list[tuple[float, list]]:
    """The same requests read by a bare asyncio client: one connection each, the chunked body split into SSE events
    by hand (each event is one `data:` line, server/responses.py), each event's JSON parsed and its token_ids
    counted. What a client leaner than `evalpipe bench`'s aiohttp stack pays per event; `evalpipe serve` only."""
    url = urlsplit(base)

    async def one(prompt):
        body = json.dumps(request_body(model, prompt, new_tokens)).encode()
        reader, writer = await asyncio.open_connection(url.hostname, url.port)
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        sent = time.perf_counter()
        writer.write(head.encode() + body)
        status = await reader.readuntil(b"\r\n\r\n")
        if not status.startswith(b"HTTP/1.1 200") or b"chunked" not in status.lower():
            raise RuntimeError(f"unexpected answer: {status[:300]!r}")
        events, pending, tokens = [], b"", 0
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    continue
                n = sum(len(c.get("token_ids") or []) for c in json.loads(payload).get("choices") or [])
                if n:
                    tokens += n
                    events.append((time.perf_counter() - sent, n))
        writer.close()
        if tokens != new_tokens:
            raise RuntimeError(f"the bare client counted {tokens} tokens, not {new_tokens}")
        return sent, events

    return await asyncio.gather(*(one(p) for p in prompts))


def steady_window(results: list[tuple[float, list]]) -> tuple[float, float, int]:
    """(start, end, tokens) of the window in which every request decodes: the last first event to the first last."""
    streams = [[(sent + t, n) for t, n in events] for sent, events in results]
    start, end = max(s[0][0] for s in streams), min(s[-1][0] for s in streams)
    tokens = sum(sum(n for t, n in s if start < t <= end) for s in streams)
    return start, end, tokens


def served(args, concurrencies: list[int], instrumented: bool, roots: dict[str, Path]) -> dict[str, dict[int, dict]]:
    """Per arm (a server of the package under its root) and concurrency C, rounds of C streams: medians over the
    rounds' steady windows of the step wall and of each process's CPU per step; instrumented, the engine's parts and
    the HTTP process's profile. Several arms' servers run side by side and take turns round by round, so the drift
    of a shared machine falls on every arm alike."""
    import httpx

    from benchmarks.serving.gpu_real_job import find

    serve_args = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--max-batch", "64"]
    serve_args += ["--stream-interval", str(args.stream_interval)]
    servers: dict[str, ServedChild] = {}
    results: dict[str, dict[int, dict]] = {arm: {} for arm in roots}
    try:
        for arm, root in roots.items():
            ledger = tempfile.mktemp(prefix="host-cost-ledger-", suffix=".json") if instrumented else None
            profile = tempfile.mktemp(prefix="host-cost-http-", suffix=".json") if instrumented else None
            servers[arm] = ServedChild(serve_args + ["--prefix-cache", "off"], ledger, profile, root)
        srv = next(iter(servers.values()))
        vocab = find(httpx.get(srv.base + "/get_server_info", timeout=30).json(), "vocab_size") or 256
        model = httpx.get(srv.base + "/v1/models", timeout=30).json()["data"][0]["id"]
        sampler = CpuSampler([pid for srv in servers.values() for pid in (srv.proc.pid, srv.engine_pid)])
        try:
            for c in concurrencies:
                prompts = prompts_for(c, args.prompt_len, vocab, args.seed)
                rows: dict[str, list[dict]] = {arm: [] for arm in servers}
                bare: dict[str, list[dict]] = {arm: [] for arm in servers}
                before: dict[str, dict] = {}
                for rnd in range(args.rounds + 1):  # round 0 warms up
                    for i, (arm, srv) in enumerate(servers.items()):
                        if rnd == 1:
                            before[arm] = read_ledger(srv.ledger_path, after=0) if srv.ledger_path else {}
                            srv.profile(True)
                        got = served_round(args, srv, model, prompts, sampler, 2 * i)
                        if rnd and got:
                            rows[arm].append(got)
                        if args.bare_client and not instrumented:
                            got = served_round(args, srv, model, prompts, sampler, 2 * i, bare_stream_round)
                            if rnd and got:
                                bare[arm].append(got)
                for arm, srv in servers.items():
                    results[arm][c] = summarize(args, srv, rows[arm], before[arm], c)
                    if bare[arm]:
                        results[arm][c]["bare_client"] = {
                            k: statistics.median(r[k] for r in bare[arm]) for k in bare[arm][0]
                        }
        finally:
            sampler.stop()
    finally:
        for srv in servers.values():
            srv.stop()
    return results


def served_round(
    args, srv: "ServedChild", model: str, prompts: list[list[int]], sampler: "CpuSampler", at: int, client=None
):
    """One round of C streams (read by `client`, default `stream_round`): per decode step in its steady window, the
    wall and the CPU of the server's HTTP and engine processes (the sampler's columns `at` and `at + 1`) and of the
    client."""
    concurrency = len(prompts)
    client = client or stream_round
    start, end, tokens = steady_window(asyncio.run(client(srv.base, model, prompts, args.new_tokens)))
    if tokens <= 0:
        return None
    first, last = sampler.at(start), sampler.at(end)
    steps = tokens / concurrency
    return {
        "wall_us": (end - start) / steps * 1e6,
        "http_cpu_us": (last[at] - first[at]) / steps * 1e6,
        "engine_cpu_us": (last[at + 1] - first[at + 1]) / steps * 1e6,
        "client_cpu_us": (last[-1] - first[-1]) / steps * 1e6,
    }


def summarize(args, srv: "ServedChild", rows: list[dict], before: dict, concurrency: int) -> dict:
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    if out:
        out["tok_s"] = concurrency / out["wall_us"] * 1e6
    if srv.ledger_path:
        after = read_ledger(srv.ledger_path, after=sum(b["steps"] for b in before.values()))
        out["parts"] = per_step_us(diff(after, before), concurrency)
    if srv.profile_path:
        out["http_profile"] = srv.profile(False, steps=args.rounds * args.new_tokens)
    return out


def read_ledger(path: str, after: float, timeout: float = 30.0) -> dict:
    """The served engine's ledger once it holds more than `after` steps (it is written when the engine goes idle)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            snap = json.loads(Path(path).read_text())
            if sum(b["steps"] for b in snap.values()) > after:
                return snap
        if time.monotonic() > deadline:
            raise RuntimeError("the served engine wrote no ledger (was it started by --serve-child?)")
        time.sleep(0.05)


# ---- the table ------------------------------------------------------------------------------------------------------


def table(concurrency: int, arms: dict) -> str:
    """µs per decode step of C rows: the engine's parts in both arms, the walls, each process's CPU and the HTTP
    process's profile by group."""

    def cell(x: float | None) -> str:
        return "" if x is None else f"{x:,.1f}"

    inproc, srv = arms["in_process"], arms["served"]
    a, b = inproc.get("parts") or {}, srv.get("parts") or {}
    rows = [(LABELS[part], a.get(part), b.get(part)) for part in (*PARTS, "unattributed")]
    rows.insert(
        PARTS.index("zmq_send") + 1, ("- of which sends over 0.2 ms", a.get("zmq_send_slow"), b.get("zmq_send_slow"))
    )
    rows += [
        ("wall per step, instrumented", a.get("wall"), b.get("wall")),
        ("host outside the model, instrumented", a and a["wall"] - a["model"], b and b["wall"] - b["model"]),
        ("**wall per step, clean**", inproc["wall_us"], srv.get("wall_us")),
        ("HTTP process CPU, clean", None, srv.get("http_cpu_us")),
    ]
    rows += [(f"- HTTP: {group} (profiled)", None, us) for group, us in sorted((srv.get("http_profile") or {}).items())]
    rows += [
        ("engine process CPU, clean", None, srv.get("engine_cpu_us")),
        ("client CPU, clean", None, srv.get("client_cpu_us")),
    ]
    bare = srv.get("bare_client") or {}
    rows += [
        (f"bare asyncio client: {label}", None, bare.get(key))
        for label, key in (
            ("wall per step", "wall_us"),
            ("HTTP process CPU", "http_cpu_us"),
            ("client CPU", "client_cpu_us"),
        )
        if bare
    ]
    wall = srv.get("wall_us")
    busy = ", ".join(
        f"{name} {srv[key] / wall:.0%}"
        for name, key in (("HTTP", "http_cpu_us"), ("engine", "engine_cpu_us"), ("client", "client_cpu_us"))
        if wall and key in srv
    )
    lines = [
        f"| C{concurrency}: µs per decode step of {concurrency} rows | in-process | served | served - in-process "
        "| served per token |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, x, y in rows:
        d = (y - x) if x is not None and y is not None else None
        lines.append(
            f"| {label} | {cell(x)} | {cell(y)} | {cell(d)} | {cell(y / concurrency if y is not None else None)} |"
        )
    ratio = srv["tok_s"] / inproc["tok_s"] if srv.get("tok_s") else float("nan")
    lines.append(
        f"| decode tok/s, clean | {inproc['tok_s']:,.0f} | {srv.get('tok_s', 0):,.0f} | served / in-process "
        f"{ratio:.2f} | |"
    )
    lines.append(
        f"| steps in the parts (in-process / served) | {a.get('steps', 0):.0f} | {b.get('steps', 0):.0f} | | |"
    )
    lines.append(f"| served processes busy (CPU / wall; 100% = one core) | | {busy} | | |")
    return "\n".join(lines)


def compare_table(concurrency: int, arms: dict) -> str:
    """The served arm of `--baseline`'s tree beside this tree's: µs per decode step and this / baseline."""
    base, new = arms["baseline"], arms["served"]
    a, b = base.get("parts") or {}, new.get("parts") or {}
    rows = [(LABELS[part], a.get(part), b.get(part)) for part in ("pickle", "zmq_send", "hand_off", "messages_in")]
    rows += [
        ("host outside the model, instrumented", a and a["wall"] - a["model"], b and b["wall"] - b["model"]),
        ("**wall per step, clean**", base.get("wall_us"), new.get("wall_us")),
        ("HTTP process CPU, clean", base.get("http_cpu_us"), new.get("http_cpu_us")),
        ("engine process CPU, clean", base.get("engine_cpu_us"), new.get("engine_cpu_us")),
        ("client CPU, clean", base.get("client_cpu_us"), new.get("client_cpu_us")),
    ]
    lines = [
        f"| C{concurrency}, served: µs per decode step | baseline tree | this tree | this / baseline |",
        "|---|---:|---:|---:|",
    ]
    for label, x, y in rows:
        ratio = f"{y / x:.2f}" if x and y is not None else ""
        lines.append(f"| {label} | {'' if x is None else f'{x:,.1f}'} | {'' if y is None else f'{y:,.1f}'} | {ratio} |")
    return "\n".join(lines)


def prepare_baseline(root: Path) -> Path:
    """`root`, holding this script (copied in when its tree predates it), so its server can run as --serve-child."""
    root = root.resolve()
    if not (root / "evalpipe").is_dir():
        raise SystemExit(f"--baseline {root}: no evalpipe package there")
    target = root / "benchmarks" / "serving" / Path(__file__).name
    if not target.exists():
        target.write_text(Path(__file__).read_text())
    return root


def serve_child(argv: list[str]) -> None:
    """Run `evalpipe serve ARGV` in this process (its engine process then imports this module as __mp_main__)."""
    import cProfile

    from evalpipe.cli import main

    path, profiler = os.environ.get(PROFILE_ENV), cProfile.Profile()
    if path:
        signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())  # handlers run on the main (event loop) thread
        signal.signal(signal.SIGUSR2, lambda *_: (profiler.disable(), write_profile(profiler, path)))
    main(args=["serve", *argv], prog_name="evalpipe")


def write_profile(profiler, path: str) -> None:
    """Own time of every profiled function, summed by HTTP_GROUPS, to `path`; the profile starts over."""
    import pstats

    groups: dict[str, float] = defaultdict(float)
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        where = filename if filename != "~" else name
        group = next((g for g, keys in HTTP_GROUPS if any(k in where for k in keys)), "other")
        if group != "idle":  # the event loop waiting for work is no CPU
            groups[group] += tottime
    if os.environ.get("HOST_COST_HTTP_PSTATS"):  # the whole profile too, for a closer look (pstats.Stats(file))
        profiler.dump_stats(os.environ["HOST_COST_HTTP_PSTATS"])
    profiler.clear()
    Path(path + ".tmp").write_text(json.dumps(groups))
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-child"]:
        serve_child(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: --model; cuda: v4-top2 in bf16")
    ap.add_argument("--model", default=None, help="checkpoint or built-in name (cpu default: evalpipe-tiny-dsv4)")
    ap.add_argument("--concurrency", default="64,1", help="comma-separated concurrencies (default 64,1)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    ap.add_argument("--new-tokens", type=int, default=128, help="generated tokens per request (default 128)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per arm after one warm-up (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument(
        "--stream-interval", type=int, default=1, help="the engine's --stream-interval in both arms (default 1)"
    )
    ap.add_argument(
        "--bare-client",
        action="store_true",
        help="also read every round with a bare asyncio client (alternating with the `evalpipe bench`-like one): "
        "what the client's own cost per event does to the served rows",
    )
    ap.add_argument("--out", default=None, help="folder for host_cost.json (default: only print)")
    ap.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another source tree of evalpipe (e.g. `git archive COMMIT | tar -x -C DIR`): its server runs beside "
        "this tree's, and a second table compares the two (this script is copied into it if it lacks it)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="C2 alone, 8 tokens, one round, --bare-client too (under half a minute)"
    )
    args = ap.parse_args(argv)
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.smoke:
        args.concurrency, args.new_tokens, args.rounds, args.prompt_len = "2", 8, 1, 8  # every step at one C
        args.bare_client = True
    tmp = None
    if args.device == "cuda" and args.model is None:
        from benchmarks.serving.gpu_real_job import write_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="host-cost-v4-top2-")
        write_checkpoint(Path(tmp.name), smoke=False)
        args.model = tmp.name
    args.model = args.model or "evalpipe-tiny-dsv4"
    report = {k: getattr(args, k) for k in ("device", "model", "prompt_len", "new_tokens", "stream_interval")}
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    try:
        engine = build(args)
        inproc = {c: (in_process(args, engine, c, None), in_process(args, engine, c, Ledger())) for c in concurrencies}
        del engine
        gc.collect()
        if args.device == "cuda":
            import torch

            torch.cuda.empty_cache()
        roots = {"served": REPO}
        if args.baseline is not None:
            roots = {"baseline": prepare_baseline(args.baseline), **roots}
        clean = served(args, concurrencies, False, roots)
        parts = served(args, concurrencies, True, roots)
    finally:
        if tmp is not None:
            tmp.cleanup()
    for c in concurrencies:
        report[f"C{c}"] = {"in_process": {**inproc[c][0], "parts": inproc[c][1]["parts"]}}
        for arm in roots:
            got = parts[arm][c]
            report[f"C{c}"][arm] = {**clean[arm][c], "parts": got.get("parts"), "http_profile": got.get("http_profile")}
        print(table(c, report[f"C{c}"]), flush=True)
        print(flush=True)
        if args.baseline is not None:
            print(compare_table(c, report[f"C{c}"]), flush=True)
            print(flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "host_cost.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
