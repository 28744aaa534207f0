"""The default model's targets (issue 13), measured end to end through `evalpipe serve`, `run` and `compare`, and
printed as one table. Every number comes from the run folders this script leaves under --out.

    python -m benchmarks.model.default_model_targets --out results/targets [--arith-examples 1200]
        [--serve-args "--device cuda"] [--run-args "--concurrency 64"]

Rows:
- greedy exact answers, speculation off: arith (per operation count), retrieval (per depth), copy (per length);
- layerskip drafter (G=5, greedy) on arith: accept length, and output agreement with plain decoding;
- temperature 1, spec on vs off, arith: accuracy difference and McNemar p (target: inside 2 points, p >= 0.01);
- a lossy speculator (greedy; default --lossy-args: the untrained layer-1 exit as drafter, accepted whenever it is
  in the target's top 4) against exact: flips, McNemar p, verdict (target: p < 0.01 and not "non-inferior"). The
  trained layer-4 drafter nearly always proposes the target's own argmax, so top-k acceptance behind it changes
  few tokens; a weaker drafter behind the same knob is what the check has to catch.
Servers are booted fresh for each configuration on free ports and stopped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

EVALPIPE = [sys.executable, "-m", "evalpipe.cli"]
RUN_EXTRA: list[str] = []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    extra: list[str] = []

    def __init__(self, *args: str, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.cmd = [*EVALPIPE, "serve", "--port", str(self.port), *args, *self.extra]
        print("$", " ".join(self.cmd[2:]), flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health_generate", timeout=30).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited: see {log}")
            time.sleep(0.5)
        raise SystemExit(f"server not ready: see {log}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)


def run(lane: str, server: Server, out: Path, arm: str, *extra: str) -> dict:
    cmd = [
        *EVALPIPE,
        "run",
        lane,
        "--base-url",
        server.url,
        "--out",
        str(out),
        "--arm",
        arm,
        "--no-progress",
        *RUN_EXTRA,
        *extra,
    ]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    run_dir = sorted((out / lane).glob(f"{arm}-*"))[-1]
    return {"dir": run_dir, "summary": json.loads((run_dir / "summary.json").read_text())}


def compare(a: dict, b: dict, out: Path, *extra: str) -> dict:
    cmd = [*EVALPIPE, "compare", str(a["dir"]), str(b["dir"]), "--out", str(out), *extra]
    print("$", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    return json.loads((out / "compare.json").read_text())


def groups(summary: dict) -> str:
    return ", ".join(f"{g} {100 * v['accuracy']:.1f}%" for g, v in (summary.get("by_group") or {}).items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--out", type=Path, default=None, help="folder for the run folders and logs (required but with --smoke)"
    )
    ap.add_argument("--model", default="evalpipe-skills-dsv4")
    ap.add_argument("--arith-examples", type=int, default=1200, help="arith items per run (1200 = the whole lane)")
    ap.add_argument("--skip", default="", help="comma-separated rows to skip: greedy,spec,t1,lossy")
    ap.add_argument("--serve-args", default="", help='added to every `evalpipe serve` (e.g. "--device cuda")')
    ap.add_argument("--run-args", default="", help='added to every `evalpipe run` (e.g. "--concurrency 64")')
    ap.add_argument(
        "--lossy-args",
        default="--drafter layerskip:1 --spec-accept-topk 4",
        help="the lossy server's flags, added to `--speculative block`",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check: the tiny model, 3 items per lane, 8 tokens, the greedy and spec rows only",
    )
    args = ap.parse_args()
    if args.smoke:
        args.model, args.arith_examples, args.skip = "evalpipe-tiny-dsv4", 3, "t1,lossy"
        args.run_args += " --num-examples 3 --max-tokens 8"
        args.out = args.out or Path(tempfile.mkdtemp(prefix="default-model-targets-"))
    elif args.out is None:
        ap.error("--out is required")
    Server.extra = shlex.split(args.serve_args)
    RUN_EXTRA.extend(shlex.split(args.run_args))
    skip = set(args.skip.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    n = ["--num-examples", str(args.arith_examples)]
    rows = []
    t0 = time.time()
    with Server("--model", args.model, log=args.out / "serve-off.log") as off:
        if "greedy" not in skip:
            for lane in ("arith", "retrieval", "copy"):
                r = run(lane, off, args.out / "greedy", "off", *(n if lane == "arith" else []))
                s = r["summary"]
                rows.append((f"greedy {lane}", f"{100 * s['accuracy']:.1f}% of {s['n_planned']}", groups(s), r["dir"]))
        greedy_off = run("arith", off, args.out / "spec", "off", *n) if {"spec", "lossy"} - skip else None
        t1_off = run("arith", off, args.out / "t1", "off", *n, "--temperature", "1") if "t1" not in skip else None
    if "spec" not in skip or "t1" not in skip:
        with Server("--model", args.model, "--speculative", "block", log=args.out / "serve-on.log") as on:
            if "spec" not in skip:
                greedy_on = run("arith", on, args.out / "spec", "on", *n)
                c = compare(greedy_off, greedy_on, args.out / "compare-spec", "--intended", "*spec*")
                agree = c["agreement"]
                rows.append(
                    (
                        "layerskip accept length (G=5, greedy arith)",
                        f"{c['spec']['b']['accept_length_mean']:.2f}",
                        f"outputs identical to spec off: {agree.get('n_identical')}/{agree.get('n_pairs')}",
                        args.out / "compare-spec",
                    )
                )
            if "t1" not in skip:
                t1_on = run("arith", on, args.out / "t1", "on", *n, "--temperature", "1")
                c = compare(t1_off, t1_on, args.out / "compare-t1", "--intended", "*spec*", "--margin", "2")
                g = c["greedy"]
                rows.append(
                    (
                        "T=1 arith, spec on - off",
                        f"{100 * g['diff']:+.2f} pt",
                        f"{100 * g['n_correct_a'] / g['n']:.1f}% vs {100 * g['n_correct_b'] / g['n']:.1f}%; "
                        f"McNemar p {g['mcnemar_p']:.3g}; Tango CI [{100 * g['interval']['low']:.2f}, "
                        f"{100 * g['interval']['high']:.2f}] pt; {g['verdict']} at -2 pt",
                        args.out / "compare-t1",
                    )
                )
    if "lossy" not in skip:
        with Server(
            "--model",
            args.model,
            "--speculative",
            "block",
            *shlex.split(args.lossy_args),
            log=args.out / "serve-lossy.log",
        ) as lossy:
            r = run("arith", lossy, args.out / "lossy", "lossy", *n)
            c = compare(greedy_off, r, args.out / "compare-lossy", "--intended", "*spec*")
            g = c["greedy"]
            rows.append(
                (
                    f"lossy ({args.lossy_args}) vs exact (greedy arith)",
                    f"{100 * g['diff']:+.2f} pt",
                    f"{g['a_only']} lost / {g['b_only']} gained; McNemar p {g['mcnemar_p']:.3g}; {g['verdict']}",
                    args.out / "compare-lossy",
                )
            )
    print(f"\nDefault-model targets ({args.model}), {time.time() - t0:.0f} s")
    width = max(len(r[0]) for r in rows)
    for name, value, detail, where in rows:
        print(f"{name:<{width}}  {value:>16}  {detail}  [{os.path.relpath(where)}]")


if __name__ == "__main__":
    main()
