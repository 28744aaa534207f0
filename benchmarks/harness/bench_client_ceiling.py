"""How many streamed events per second can `evalpipe bench` itself take in? Its ceiling, so a served rate near it
is read as the client's limit, not the server's.

    python -m benchmarks.harness.bench_client_ceiling [--concurrency 64] [--output-len 512] [--rounds 3]

Against the scripted streaming peer of the tests (tests/support/bench_peer.py, a real process on 127.0.0.1) that
sends one token per event (with no delay, or `--event-delay-ms` apart, so that each read carries one event as it does
from a served engine that steps every few ms), so the peer and the client are all there is: `evalpipe bench`'s own code
(harness/bench.run_bench) runs `--rounds` rounds of `--concurrency` streams of `--output-len` tokens after one
warm-up round; the table gives the median aggregate tokens (= events) per second and the CPU microseconds per event
of the client (this process, getrusage) and of the peer (/proc). With a gap the peer's timers, not the client, may
set the rate; the client's CPU per event is the number to carry to another machine. `--smoke`: 2 streams of 8
tokens, 1 round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import sys

from benchmarks.harness.harness_overhead import proc_cpu_s
from evalpipe.harness.bench import BenchConfig, run_bench
from tests.support.bench_peer import start_peer


def client_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


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
        cfg = BenchConfig(
            base_url=base_url,
            input_len=16,
            output_len=args.output_len,
            rounds=args.rounds,
            warmup=1,
            concurrency=args.concurrency,
            flush=False,
        )
        peer0, client0 = proc_cpu_s(peer_pid), client_cpu()
        result = asyncio.run(run_bench(cfg))
        events = sum(r["n_events"] for r in result["requests"])
        rate = statistics.median(result["results"]["aggregate_tokens_per_s"]["values"])
        client_us = (client_cpu() - client0) / events * 1e6
        peer_us = (proc_cpu_s(peer_pid) - peer0) / events * 1e6
    print("\n| streams | event gap ms | aggregate tok/s (median) | client CPU us/event | peer CPU us/event |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {args.concurrency} | {args.event_delay_ms:g} | {rate:,.0f} | {client_us:.0f} | {peer_us:.0f} |")
    return 0


def _is_peer(pid: int, port: str) -> bool:
    """The peer process started for this run: its command line names the module and this port."""
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return b"tests.support.bench_peer" in args and port.encode() in args


if __name__ == "__main__":
    sys.exit(main())
