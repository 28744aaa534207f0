"""How many streamed events per second can `evalpipe bench` itself take in? Its ceiling, so a served rate near it
is read as the client's limit, not the server's.

    python -m benchmarks.harness.bench_client_ceiling [--concurrency 64] [--output-len 512] [--rounds 3]
        [--event-delay-ms 2.7] [--client-processes N] [--profile FILE]

Against the scripted streaming peer of the tests (tests/support/bench_peer.py, a real process on 127.0.0.1) that
sends one token per event (with no delay, or `--event-delay-ms` apart, so that each read carries one event as it does
from a served engine that steps every few ms), so the peer and the client are all there is: `evalpipe bench`'s own code
(harness/bench.run_bench) runs `--rounds` rounds of `--concurrency` streams of `--output-len` tokens after one
warm-up round; the table gives the median aggregate tokens (= events) per second and the CPU microseconds per event
over the measured rounds of the client (this process and its `--client-processes` workers) and of the peer (/proc).
With a gap the peer's timers, not the client, may set the rate; the client's CPU per event is the number to carry to
another machine. `--profile FILE` also writes this process's cProfile stats (pstats format; it slows the client, so
its CPU row is not comparable then) and prints its 25 costliest functions by own time. `--smoke`: 2 streams of 8
tokens, 1 round.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import resource
import statistics
import sys

from benchmarks.harness.harness_overhead import proc_cpu_s
from evalpipe.harness.bench import BenchConfig, run_bench
from tests.support.bench_peer import start_peer


def client_cpu(peer_pid: int) -> float:
    """CPU seconds of this process and of its live children but the peer (bench's client workers), from /proc."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = [int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(int(p)) == os.getpid()]
    return own.ru_utime + own.ru_stime + sum(proc_cpu_s(pid) for pid in children if pid != peer_pid)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64, help="streams per round")
    ap.add_argument("--output-len", type=int, default=512, help="tokens (= events) per stream")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds per row (one warm-up round first)")
    ap.add_argument(
        "--event-delay-ms",
        type=float,
        default=0.0,
        help="the peer's pause between two events of a stream (0: as fast as it can; 2.7: the H200's C64 step, so "
        "each read carries one event as from a served engine)",
    )
    ap.add_argument(
        "--client-processes", type=int, default=1, help="evalpipe bench --client-processes (their CPU is counted)"
    )
    ap.add_argument(
        "--profile", metavar="FILE", default=None, help="write the client's cProfile stats to FILE and print its top 25"
    )
    ap.add_argument("--smoke", action="store_true", help="2 streams of 8 tokens, 1 round (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.concurrency, args.output_len, args.rounds = 2, 8, 1
    print(
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {args.concurrency} streams x "
        f"{args.output_len} one-token events per round",
        flush=True,
    )
    with start_peer(
        stream_groups=[1] * args.output_len,
        event_delay_s=args.event_delay_ms / 1e3,
        variants=[list(range(16, 16 + args.output_len))],
    ) as (base_url, _):
        port = base_url.rsplit(":", 1)[1].split("/")[0]
        peer_pid = next((int(p) for p in os.listdir("/proc") if p.isdigit() and _is_peer(int(p), port)), -1)
        workers = {"client_processes": args.client_processes} if args.client_processes > 1 else {}
        cfg = BenchConfig(
            base_url=base_url,
            input_len=16,
            output_len=args.output_len,
            rounds=args.rounds,
            warmup=1,
            concurrency=args.concurrency,
            flush=False,
            **workers,
        )
        cpu: dict[int, tuple[float, float]] = {}

        def progress(done: int, total: int) -> None:
            if done in (1, total):  # after the warm-up round and after the last one: every client process is alive
                cpu[done] = (client_cpu(peer_pid), proc_cpu_s(peer_pid))

        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        result = asyncio.run(run_bench(cfg, progress))
        if profiler:
            profiler.disable()
        events = sum(r["n_events"] for r in result["requests"] if not r["warmup"])
        rate = statistics.median(result["results"]["aggregate_tokens_per_s"]["values"])
        (client0, peer0), (client1, peer1) = cpu[1], cpu[1 + args.rounds]
        client_us, peer_us = (client1 - client0) / events * 1e6, (peer1 - peer0) / events * 1e6
    print(
        "\n| streams | event gap ms | client processes | aggregate tok/s (median) | client CPU us/event "
        "| peer CPU us/event |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {args.concurrency} | {args.event_delay_ms:g} | {args.client_processes} | {rate:,.0f} | {client_us:.0f} "
        f"| {peer_us:.0f} |"
    )
    if profiler:
        profiler.dump_stats(args.profile)
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(25)
    return 0


def _parent(pid: int) -> int:
    try:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _is_peer(pid: int, port: str) -> bool:
    """The peer process started for this run: its command line names the module and this port."""
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return b"tests.support.bench_peer" in args and port.encode() in args


if __name__ == "__main__":
    sys.exit(main())
