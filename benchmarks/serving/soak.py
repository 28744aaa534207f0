"""Soak test of `evalpipe serve`: N streaming clients for M minutes, some of them hanging up mid-stream.

Each client sends streamed completions back to back (a short random text prompt, random max_tokens, greedy or
sampled, ignore_eos so every request runs its full length). A fraction of requests (10% by default) is abandoned
after a few events: the client closes the connection, as a user pressing Ctrl-C would. Every other stream is read
to `[DONE]` with the SSE parser evalpipe uses (httpx-sse) and checked: one finish reason, the final usage equal to
the token ids streamed, no error event. At the end the server must be idle (nothing running or waiting, no slot
allocated) and its memory must not have grown.

Prints: requests completed and abandoned, failures by kind (anything else: HTTP status, transport error, bad
stream), decode tok/s (all tokens streamed, abandoned ones included, over the wall time), TTFT p50/p95 of the
completed requests, server RSS after the warm-up and at the end (from /proc, so the server runs on this machine),
and the allocated slots, running and waiting counts afterwards.

    python -m benchmarks.serving.soak [--clients 64] [--minutes 10] [--disconnect 0.1] [--warmup-s 30]
    python -m benchmarks.serving.soak --base-url http://127.0.0.1:30000/v1 --server-pid PID   # a server already running

Without --base-url it starts `evalpipe serve` (default settings: max batch 64, max seq len 4096) on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from httpx_sse import EventSource

from evalpipe.qualify.soak import rss_mb

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = (16, 160)  # a request's max_tokens is drawn from this range
SMOKE_MAX_TOKENS = (4, 12)  # --smoke: short requests, so the last ones end soon after the window
WORDS = "the of and to in is that for it as was with be by on not he this are or his from at which but".split()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "evalpipe.cli", "serve", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(REPO),
    )
    root = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    with httpx.Client(timeout=30) as client:  # one client: each new one builds an SSL context (~30 ms of CPU)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"evalpipe serve exited:\n{log_path.read_text()[-3000:]}")
            try:
                if client.get(root + "/health_generate").status_code == 200:
                    return proc, root + "/v1"
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("evalpipe serve was not ready after 300 s")


class Tally:
    def __init__(self):
        self.completed = 0
        self.abandoned = 0
        self.failures: Counter = Counter()
        self.failure_examples: dict[str, str] = {}
        self.tokens = 0
        self.ttft: list[float] = []

    def fail(self, kind: str, detail: str) -> None:
        self.failures[kind] += 1
        self.failure_examples.setdefault(kind, detail[:300])


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    rng: random.Random,
    tally: Tally,
    abandon: bool,
    measuring: bool,
    max_tokens: tuple[int, int],
) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))
    body = {
        "prompt": prompt,
        "max_tokens": rng.randint(*max_tokens),
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randint(0, 1 << 30),
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    stop_after = rng.randint(1, 6) if abandon else None
    t0 = time.perf_counter()
    first = None
    streamed = 0
    finish = []
    usage = None
    done = False
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                if measuring:
                    tally.fail(f"HTTP {resp.status_code}", text)
                return
            events = 0
            async for event in EventSource(resp).aiter_sse():
                if event.data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(event.data)
                if "error" in chunk and not chunk.get("choices"):
                    raise ValueError(f"error event: {event.data[:200]}")
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids") or []
                    if ids and first is None:
                        first = time.perf_counter() - t0
                    streamed += len(ids)
                    if choice.get("finish_reason"):
                        finish.append(choice["finish_reason"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                events += 1
                if stop_after is not None and events >= stop_after:
                    break  # hang up: leaving the context closes the connection mid-stream
    except (httpx.HTTPError, ValueError) as exc:
        if measuring:
            tally.fail(type(exc).__name__, str(exc))
        return
    if not measuring:
        return
    tally.tokens += streamed
    if stop_after is not None and not done:
        tally.abandoned += 1
        return
    if not done:
        tally.fail("stream ended without [DONE]", json.dumps(body)[:200])
    elif len(finish) != 1 or finish[0] != "length":
        tally.fail("finish reason", f"{finish} for max_tokens {body['max_tokens']}")
    elif usage is None or usage.get("completion_tokens") != streamed or streamed != body["max_tokens"]:
        tally.fail("token count", f"streamed {streamed}, usage {usage}, max_tokens {body['max_tokens']}")
    else:
        tally.completed += 1
        tally.ttft.append(first)


async def client_loop(
    i: int,
    url: str,
    deadline: float,
    warm_until: float,
    disconnect: float,
    max_tokens: tuple[int, int],
    tally: Tally,
) -> None:
    rng = random.Random(i)
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1)) as client:
        while time.monotonic() < deadline:
            measuring = time.monotonic() >= warm_until
            await one_request(client, url, rng, tally, rng.random() < disconnect, measuring, max_tokens)


def quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1] if len(xs) > 1 else xs[0]


async def soak(
    url: str,
    clients: int,
    seconds: float,
    warmup_s: float,
    disconnect: float,
    max_tokens: tuple[int, int],
    pid: int | None,
    root: str,
) -> dict:
    tally = Tally()
    t_start = time.monotonic()
    warm_until = t_start + warmup_s
    deadline = warm_until + seconds
    rss = {"ready": rss_mb(pid)}

    async def sample_rss():
        await asyncio.sleep(max(0.0, warm_until - time.monotonic()))
        rss["start"] = rss_mb(pid)

    sampler = asyncio.create_task(sample_rss())
    tasks = [
        asyncio.create_task(client_loop(i, url, deadline, warm_until, disconnect, max_tokens, tally))
        for i in range(clients)
    ]
    await asyncio.sleep(max(0.0, warm_until - time.monotonic()))
    t_measure = time.monotonic()
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t_measure
    await sampler
    rss["end"] = rss_mb(pid)
    # afterwards: the server must settle to idle
    after = {}
    async with httpx.AsyncClient(timeout=30) as client:
        settle_deadline = time.monotonic() + 10
        while True:
            after = (await client.get(root + "/get_server_info")).json()["internal_states"]
            if (after["running"], after["waiting"], after["allocated_slots"]) == (
                0,
                0,
                0,
            ) or time.monotonic() > settle_deadline:
                break
            await asyncio.sleep(0.1)
    return {"tally": tally, "wall_s": wall, "rss": rss, "after": after}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    ap.add_argument("--minutes", type=float, default=10.0, help="measured duration (default 10)")
    ap.add_argument(
        "--warmup-s",
        type=float,
        default=30.0,
        help="load before measuring starts; RSS at start is taken at its end (default 30)",
    )
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of requests abandoned mid-stream (0.1)")
    ap.add_argument("--base-url", default=None, help="an already running server (default: start evalpipe serve)")
    ap.add_argument("--server-pid", type=int, default=None, help="its pid, for RSS (with --base-url)")
    ap.add_argument("--json", dest="json_out", default=None, help="also write the results here")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check: 2 clients, 0.5 s warm-up, 1.2 s measured, 4 to 12 tokens a request, half abandoned",
    )
    args = ap.parse_args()
    max_tokens = MAX_TOKENS
    if args.smoke:  # half abandoned, so both a finished and an abandoned request are likely
        args.clients, args.warmup_s, args.minutes, args.disconnect = 2, 0.5, 0.02, 0.5
        max_tokens = SMOKE_MAX_TOKENS

    proc = log_path = None
    if args.base_url:
        url, pid = args.base_url.rstrip("/"), args.server_pid
    else:
        log_path = Path(tempfile.mkstemp(prefix="soak-serve-", suffix=".log")[1])
        proc, url = start_server(log_path)
        pid = proc.pid
    root = url[:-3] if url.endswith("/v1") else url
    try:
        print(
            f"soak: {args.clients} streaming clients, {args.warmup_s:g} s warm-up + {args.minutes:g} min measured, "
            f"{100 * args.disconnect:g}% abandoned mid-stream, against {url}",
            flush=True,
        )
        res = asyncio.run(
            soak(
                url + "/completions",
                args.clients,
                args.minutes * 60,
                args.warmup_s,
                args.disconnect,
                max_tokens,
                pid,
                root,
            )
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    tally, rss, after = res["tally"], res["rss"], res["after"]
    server_log = log_path.read_text() if proc is not None else ""
    tracebacks = server_log.count("Traceback")
    growth = (100 * (rss["end"] - rss["start"]) / rss["start"]) if rss.get("start") and rss.get("end") else None

    def f(x, digits=1):
        return "n/a" if x is None else f"{x:.{digits}f}"

    failures = ", ".join(f"{k}: {v}" for k, v in tally.failures.most_common()) or "none"
    rows = [
        ("clients / measured time", f"{args.clients} / {res['wall_s']:.0f} s (after {args.warmup_s:g} s warm-up)"),
        ("requests completed (checked)", str(tally.completed)),
        ("requests abandoned mid-stream", str(tally.abandoned)),
        ("failures by kind", failures),
        ("decode tok/s (all streamed tokens / wall)", f(tally.tokens / res["wall_s"] if res["wall_s"] else None)),
        ("TTFT p50 / p95 (s)", f"{f(quantile(tally.ttft, 0.5), 3)} / {f(quantile(tally.ttft, 0.95), 3)}"),
        (
            "server RSS ready / start / end (MiB)",
            f"{f(rss.get('ready'))} / {f(rss.get('start'))} / {f(rss.get('end'))}",
        ),
        ("RSS growth start -> end", "n/a" if growth is None else f"{growth:+.2f}%"),
        (
            "afterwards: allocated slots / running / waiting",
            f"{after.get('allocated_slots')} / {after.get('running')} / {after.get('waiting')}",
        ),
        ("server aborted (engine stats)", str((after.get("stats") or {}).get("aborted"))),
        ("tracebacks in the server log", str(tracebacks) if proc is not None else "n/a (external server)"),
    ]
    print("\n| quantity | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    for kind, example in tally.failure_examples.items():
        print(f"example of {kind}: {example}")
    ok = (
        not tally.failures and after.get("allocated_slots") == 0 and (growth is None or growth < 5.0) and not tracebacks
    )
    print(f"\ntarget (0 failures, slots back to 0, RSS growth < 5%, no tracebacks): {'met' if ok else 'NOT met'}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "completed": tally.completed,
                    "abandoned": tally.abandoned,
                    "failures": dict(tally.failures),
                    "failure_examples": tally.failure_examples,
                    "tokens": tally.tokens,
                    "wall_s": res["wall_s"],
                    "ttft_s": tally.ttft,
                    "rss_mb": rss,
                    "after": after,
                    "tracebacks": tracebacks,
                },
                indent=1,
            )
        )
    if log_path is not None:
        os.unlink(log_path)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
