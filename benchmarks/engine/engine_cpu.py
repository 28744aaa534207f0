"""Decode throughput of the native engine's ModelRunner vs transformers `generate`, same weights, same process.

Rows: transformers generate at batch 1 (cached greedy decode), the runner at batch 1, and the runner's aggregate
throughput with 64 concurrent sequences (one batched forward of 64 decode rows per step). The "via HTTP" column
serves the same prompts through `evalpipe serve` (HTTP process + engine process; streamed, exact per-event token
counts; see `bench_http`), and "HTTP / runner" is its share of the runner's rate at the same batch (target at 64
concurrent: >= 90%); "HTTP steady" counts only the time every request is decoding (`steady_rate`), as the runner
rows do. Decode only: prefill is done before the clock starts (for generate: time(prompt + N new) -
time(prompt + 1 new)).

    python -m benchmarks.engine.engine_cpu [--model PATH] [--new-tokens 64] [--prompt-len 64] [--threads 1] [--pin]

`--pin` (two or more CPUs) gives the model one CPU in both measurements: the runner rows run on the last CPU, and
so does the served engine process, while the HTTP process and the benchmark's client share the others. Unpinned,
the engine, the HTTP process and the client compete for the same cores as the runner never had to.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def bench_generate(model, prompt: list[int], new_tokens: int, repeats: int) -> float:
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        assert out.shape[1] == len(prompt) + n
        return time.perf_counter() - t

    timed(2)  # warm-up
    samples = [(timed(new_tokens + 1) - timed(1)) for _ in range(repeats)]
    return new_tokens / statistics.median(samples)


def bench_runner(runner, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        seqs = [runner.allocate() for _ in prompts]
        logits = runner.forward(seqs, prompts)
        nxt = [[int(t)] for t in logits.argmax(-1)]
        logits = runner.forward(seqs, nxt)  # warm-up step
        nxt = [[int(t)] for t in logits.argmax(-1)]
        t = time.perf_counter()
        for _ in range(new_tokens):
            logits = runner.forward(seqs, nxt)
            nxt = [[int(t)] for t in logits.argmax(-1)]
        rates.append(len(seqs) * new_tokens / (time.perf_counter() - t))
        for s in seqs:
            runner.free(s)
    return statistics.median(rates)


def steady_rate(streams: list[list[tuple[float, int]]]) -> float:
    """Tokens/s of all requests together while every one of them is decoding: from the last request's first event
    to the first request's last event. That is what the runner rows time (every prompt prefilled before the clock,
    then only decode steps); a request's own window (`bench_http`'s sum of rates) also holds the prefill of the
    requests admitted after it. `streams`: per request, (time, cumulative completion tokens) of each event."""
    start = max(ev[0][0] for ev in streams)
    end = min(ev[-1][0] for ev in streams)
    if end <= start:
        return float("nan")

    def tokens_at(ev, t):  # cumulative tokens of the last event at or before t
        return max((n for (te, n) in ev if te <= t), default=ev[0][1])

    return sum(tokens_at(ev, end) - tokens_at(ev, start) for ev in streams) / (end - start)


def bench_http(
    model: str | None,
    prompts: list[list[int]],
    new_tokens: int,
    repeats: int,
    threads: int,
    pin: tuple[set[int], set[int]] | None = None,
) -> tuple[float, float, float]:
    """Decode tok/s through `evalpipe serve` (HTTP + SSE + scheduler + sampling) with concurrent requests.

    Streamed completions of token-id prompts, temperature 0, ignore_eos, continuous usage: each request's rate is
    (final completion tokens - tokens in its first event) / (t_last - t_first), which excludes its prefill (the
    bench protocol of serving.md E); the first figure is the sum of the concurrent requests' rates, the second the
    steady rate while all of them decode (`steady_rate`), each the median over rounds after one warm-up round. Also
    returns the server's peak RSS in MB (its /get_server_info). `pin`: (CPUs of the engine process, CPUs of the
    HTTP process and this client).
    """
    import asyncio
    import json
    import os
    import socket
    import subprocess
    import sys

    import httpx
    from httpx_sse import EventSource

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "evalpipe.cli",
        "serve",
        "--port",
        str(port),
        "--max-batch",
        str(len(prompts)),
        "--threads",
        str(threads),
        "--max-seq-len",
        str(max(map(len, prompts)) + new_tokens + 16),
    ] + (["--model", model] if model else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"evalpipe serve did not come up: {' '.join(cmd)}")
            try:
                if httpx.get(base + "/health_generate", timeout=60).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        if pin is not None:
            engine_pid = httpx.get(base + "/get_server_info", timeout=60).json()["internal_states"]["engine_process"][
                "pid"
            ]
            os.sched_setaffinity(engine_pid, pin[0])
            os.sched_setaffinity(proc.pid, pin[1])
            os.sched_setaffinity(0, pin[1])

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[tuple[float, int]]:
            body = {
                "prompt": prompt,
                "max_tokens": new_tokens + 1,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
            events = []
            async with client.stream("POST", base + "/v1/completions", json=body) as resp:
                async for event in EventSource(resp).aiter_sse():  # SSE by the spec, not by line splitting
                    if event.data.startswith("{"):
                        chunk = json.loads(event.data)
                        if chunk["choices"]:
                            events.append((time.perf_counter(), chunk["usage"]["completion_tokens"]))
            return events

        async def round_() -> tuple[float, float]:
            limits = httpx.Limits(max_connections=len(prompts) + 4)
            async with httpx.AsyncClient(timeout=None, limits=limits) as client:
                streams = await asyncio.gather(*(one(client, p) for p in prompts))
            rates = [(ev[-1][1] - ev[0][1]) / (ev[-1][0] - ev[0][0]) for ev in streams]
            return sum(rates), steady_rate(streams)

        asyncio.run(round_())  # warm-up
        rounds = [asyncio.run(round_()) for _ in range(repeats)]
        peak_rss_mb = httpx.get(base + "/get_server_info", timeout=60).json()["internal_states"]["peak_rss_mb"]
        return statistics.median(r[0] for r in rounds), statistics.median(r[1] for r in rounds), peak_rss_mb
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the seeded evalpipe-tiny-dsv4)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed per measurement")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens before decoding starts")
    ap.add_argument("--concurrency", type=int, default=64, help="sequences decoded together for the aggregate row")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per row (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (same for both engines)")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP column (evalpipe serve, streamed)")
    ap.add_argument("--pin", action="store_true", help="the model on its own CPU in both measurements (see above)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check: tiny model, prompt 8, 2 decode steps, 2 sequences, 1 repeat, no HTTP column",
    )
    args = ap.parse_args()
    if args.smoke:
        args.model, args.new_tokens, args.prompt_len, args.concurrency, args.repeats = None, 2, 8, 2, 1
        args.no_http = True
    torch.set_num_threads(args.threads)
    import os

    cpus = sorted(os.sched_getaffinity(0))
    pin = ({cpus[-1]}, set(cpus[:-1])) if args.pin and len(cpus) >= 2 else None
    if pin is not None:
        os.sched_setaffinity(0, pin[0])  # the runner rows on the engine's CPU

    from transformers import DeepseekV4ForCausalLM

    from evalpipe.engine.runner import ModelRunner

    runner = ModelRunner(args.model, max_seqs=args.concurrency, max_seq_len=args.prompt_len + args.new_tokens + 16)
    hf = DeepseekV4ForCausalLM.from_pretrained(runner.model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(16, 272, (n,), generator=gen).tolist()

    base = prompt(args.prompt_len)
    hf_tps = bench_generate(hf, base, args.new_tokens, args.repeats)
    r1 = bench_runner(runner, [base], args.new_tokens, args.repeats)
    lens = [max(1, args.prompt_len + (i % 17) - 8) for i in range(args.concurrency)]
    many = [prompt(n) for n in lens]
    r64 = bench_runner(runner, many, args.new_tokens, args.repeats)
    http, steady, peak_rss = {}, {}, {}
    if not args.no_http:  # the same prompts through the whole server: HTTP, SSE, scheduler, sampling
        for batch, prompts in ((1, [base]), (args.concurrency, many)):
            http[batch], steady[batch], peak_rss[batch] = bench_http(
                args.model, prompts, args.new_tokens, args.repeats, args.threads, pin
            )

    rows = [
        ("transformers generate", 1, hf_tps),
        ("evalpipe ModelRunner", 1, r1),
        ("evalpipe ModelRunner", args.concurrency, r64),
    ]
    print(
        f"\nmodel {runner.model_name} ({runner.describe()['parameters'] / 1e6:.2f}M params), float32, "
        f"cpu threads {args.threads}, prompt {args.prompt_len}, {args.new_tokens} decode steps, "
        f"median of {args.repeats}"
        + (f", pinned: model on CPU {sorted(pin[0])}, HTTP + client on CPU {sorted(pin[1])}" if pin else "")
    )
    print(
        f"{'engine':<24}{'batch':>6}{'decode tok/s':>14}{'vs transformers b1':>20}{'via HTTP tok/s':>16}"
        f"{'HTTP / runner':>15}{'HTTP steady':>13}{'steady / runner':>17}"
    )
    for name, batch, tps in rows:
        served = name.startswith("evalpipe") and batch in http
        via = (
            f"{http[batch]:>16.1f}{http[batch] / tps:>14.0%} {steady[batch]:>13.1f}{steady[batch] / tps:>16.0%}"
            if served
            else f"{'-':>16}{'-':>15}{'-':>13}{'-':>17}"
        )
        print(f"{name:<24}{batch:>6}{tps:>14.1f}{tps / hf_tps:>19.1f}x{via}")
    for batch, mb in peak_rss.items():
        print(f"server peak RSS at {batch} concurrent: {mb:.0f} MB (HTTP process + engine process)")
    c = args.concurrency
    print(
        f"targets: runner b1 > transformers b1 ({r1 / hf_tps:.1f}x); runner b{c} aggregate >= 8x ({r64 / hf_tps:.1f}x)"
        + (
            f"; via HTTP b{c} >= 90% of the runner: sum of per-request rates {http[c] / r64:.0%}, "
            f"steady (all {c} decoding, the runner's protocol) {steady[c] / r64:.0%}"
            if http
            else ""
        )
    )


if __name__ == "__main__":
    main()
