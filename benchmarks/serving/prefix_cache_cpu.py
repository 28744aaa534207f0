"""The five-shot GSM8K demo slice on the CPU with the prefix cache on and off, side by side in one run.

For each arm: a fresh `evalpipe serve --prefix-cache ARM` (default model unless --model), then
`evalpipe run gsm8k --num-examples N --max-tokens T` against it, timed end to end (wall clock of the run command,
server start excluded). The table takes every number from the run folders' records: prompt tokens, cached tokens
(usage.prompt_tokens_details.cached_tokens), accuracy, the server's CPU seconds during the run (its HTTP and engine
processes: a contention-robust companion to wall time on a shared machine), and whether the two arms' completions
are identical (greedy: they must be, the cache is exact). Target: the cache-on arm at least 3x faster.

    python -m benchmarks.serving.prefix_cache_cpu [--num-examples 20] [--max-tokens 64] [--concurrency N] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.server_harness import ServerProcess


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far (/proc/PID/stat): unlike wall time, barely moved by
    other processes competing for the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_arm(arm: str, args, out: Path) -> dict:
    serve_args = ["--prefix-cache", arm, "--threads", str(args.threads)]
    srv = ServerProcess(*serve_args, model=args.model)
    try:
        cmd = [
            sys.executable,
            "-m",
            "evalpipe.cli",
            "run",
            "gsm8k",
            "--base-url",
            srv.base + "/v1",
            "--num-examples",
            str(args.num_examples),
            "--max-tokens",
            str(args.max_tokens),
            "--arm",
            f"prefix_{arm}",
            "--out",
            str(out / arm),
            "--no-progress",
        ]
        if args.concurrency is not None:
            cmd += ["--concurrency", str(args.concurrency)]
        pids = (srv.proc.pid, srv.engine_pid())  # the HTTP process and the engine process it started
        cpu0, t = sum(map(server_cpu_s, pids)), time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
        wall, cpu = time.perf_counter() - t, sum(map(server_cpu_s, pids)) - cpu0
        if proc.returncode != 0:
            raise SystemExit(
                f"evalpipe run ({arm}) exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        info = httpx.get(srv.base + "/get_server_info", timeout=30).json()
    finally:
        srv.stop()
    run_dir = next((out / arm).rglob("responses.jsonl")).parent
    recs = [json.loads(line) for line in (run_dir / "responses.jsonl").read_text().splitlines()]
    usage = [r.get("usage") or {} for r in recs]
    return {
        "arm": arm,
        "wall_s": wall,
        "server_cpu_s": cpu,
        "requests": len(recs),
        "errors": sum(1 for r in recs if r.get("error")),
        "prompt_tokens": sum(u.get("prompt_tokens", 0) for u in usage),
        "cached_tokens": sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage),
        "correct": sum(1 for r in recs if r.get("correct") is True),
        "outputs": {r["question_id"]: r.get("output_token_ids") or r.get("response_text") for r in recs},
        "server_cache": info.get("prefix_cache"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: evalpipe-skills-dsv4 (--smoke: evalpipe-tiny-dsv4)")
    ap.add_argument("--num-examples", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=None, help="default: the lane's (64: every question at once)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--smoke", action="store_true", help="CI check: 2 questions, 4 tokens each, the tiny model (unless --model)"
    )
    args = ap.parse_args()
    if args.smoke:
        args.num_examples, args.max_tokens = 2, 4
    # --smoke: the tiny model's 4 layers to the default model's 6, so the five-shot prefills cost less
    args.model = args.model or ("evalpipe-tiny-dsv4" if args.smoke else "evalpipe-skills-dsv4")
    with tempfile.TemporaryDirectory(prefix="prefix-cache-bench-") as tmp:
        rows = [run_arm(arm, args, Path(tmp)) for arm in ("off", "on")]
    off, on = rows
    same = off["outputs"] == on["outputs"]
    print(
        f"\nGSM8K five-shot slice: {args.num_examples} questions, --max-tokens {args.max_tokens}, concurrency "
        f"{args.concurrency or 'lane default'}, model {args.model}, default serve settings, CPU, {args.threads} "
        "thread(s)\n"
    )
    print(
        "| --prefix-cache | wall s | server CPU s | requests | errors | prompt tokens | cached tokens | correct | "
        "speed-up (wall) | speed-up (server CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['wall_s']:.1f} | {r['server_cpu_s']:.1f} | {r['requests']} | {r['errors']} | "
            f"{r['prompt_tokens']} | {r['cached_tokens']} ({r['cached_tokens'] / max(1, r['prompt_tokens']):.0%}) | "
            f"{r['correct']} | {off['wall_s'] / r['wall_s']:.2f}x | {off['server_cpu_s'] / r['server_cpu_s']:.2f}x |"
        )
    print(
        f"\ncompletions identical across arms: {same}; target: on >= 3x faster than off -> "
        f"{'met' if off['wall_s'] / on['wall_s'] >= 3 else 'MISSED'}"
    )
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
