"""What `evalpipe serve --burst-wait-ms` does to a burst and to a one-at-a-time client: one `evalpipe serve` boot per
arm, `evalpipe bench` at C1 (time to first token) and at a burst concurrency (aggregate rate), and from the serve
log's INFO windows how many of the burst rounds went to the engine as a single prompt step.

    PYTHONPATH=. python -m benchmarks.serving.burst_wait [--arms 0,20,0,20] [--concurrency 32] [--out DIR]
        [--model DIR --serve-args "--device cuda"] [--input-len 16] [--output-len 16] [--rounds 5] [--smoke]

The engine goes idle between bench rounds (each round's requests end together), so every round starts at an idle
engine, where the burst wait acts, and ends with one INFO window line (`engine/loop.py`, StepWindow).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.server_harness import ServerProcess

WINDOW = re.compile(r"(\d+) with prompt chunks, (\d+) prompt rows each")


def bench(base: str, concurrency: int, rounds: int, args, folder: Path) -> dict:
    cmd = [sys.executable, "-m", "evalpipe.cli", "bench", "--base-url", base + "/v1"]
    cmd += ["--concurrency", str(concurrency), "--input-len", str(args.input_len)]
    cmd += ["--output-len", str(args.output_len), "--rounds", str(rounds), "--warmup", "1", "--out", str(folder)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"evalpipe bench failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(next(folder.rglob("bench.json")).read_text())["results"]


def burst_windows(log: str, rows: int) -> list[int]:
    """Prompt steps of each INFO window that fed a whole burst round (`rows` prompt rows in all)."""
    steps = []
    for m in WINDOW.finditer(log):
        n, each = int(m.group(1)), int(m.group(2))
        if n and abs(n * each - rows) <= n:  # "rows each" is rounded
            steps.append(n)
    return steps


def arm(ms: str, index: int, args) -> dict:
    srv = ServerProcess("--burst-wait-ms", ms, "--log-level", "info", *shlex.split(args.serve_args), model=args.model)
    try:
        c1 = bench(srv.base, 1, 2 * args.rounds, args, args.out / f"{index}-burst{ms}-c1")
        c = args.concurrency
        burst = bench(srv.base, c, args.rounds, args, args.out / f"{index}-burst{ms}-c{c}")
    finally:
        srv.stop()
    steps = burst_windows(srv.output(), args.concurrency * args.input_len)
    return {
        "burst_wait_ms": float(ms),
        "c1_ttft_ms": statistics.median(c1["ttft_s"]["values"]) * 1e3,
        "burst_tok_s": burst["aggregate_tokens_per_s"]["median"],
        "burst_rounds": len(steps),
        "one_step_rounds": sum(1 for n in steps if n == 1),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default="0,20,0,20", help="burst waits in ms, one serve boot each, in this order")
    ap.add_argument("--concurrency", type=int, default=32, help="requests of a burst round")
    ap.add_argument("--input-len", type=int, default=16, help="prompt tokens of every bench request")
    ap.add_argument("--output-len", type=int, default=16, help="completion tokens of every bench request")
    ap.add_argument("--rounds", type=int, default=5, help="measured bench rounds (C1 runs twice as many)")
    ap.add_argument(
        "--model", default="evalpipe-tiny-dsv4", help="`evalpipe serve --model` (a built-in name or a folder)"
    )
    ap.add_argument("--serve-args", default="", help='more `evalpipe serve` arguments, e.g. "--device cuda"')
    ap.add_argument("--out", type=Path, default=None, help="folder for the bench runs and burst_wait.json")
    ap.add_argument("--smoke", action="store_true", help="CI check: one arm (20), C4, 1 round, 4-token completions")
    args = ap.parse_args(argv)
    if args.smoke:
        args.arms, args.concurrency, args.rounds, args.output_len = "20", 4, 1, 4
    args.out = (args.out or Path(tempfile.mkdtemp(prefix="burst-wait-"))).resolve()
    rows = []
    for i, ms in enumerate(args.arms.split(",")):
        rows.append(arm(ms, i, args))
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "burst_wait.json").write_text(json.dumps(rows, indent=1))
    print(
        f"| --burst-wait-ms | C1 time to first token, ms (median) | C{args.concurrency} tok/s (median) | "
        "burst rounds as one prompt step |"
    )
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['burst_wait_ms']:g} | {r['c1_ttft_ms']:.1f} | {r['burst_tok_s']:.0f} | "
            f"{r['one_step_rounds']} of {r['burst_rounds']} |"
        )
    print(f"bench runs and burst_wait.json: {args.out}")


if __name__ == "__main__":
    main()
