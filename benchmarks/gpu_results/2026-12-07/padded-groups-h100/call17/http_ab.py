"""Before/after through HTTP on one GPU, one run: for each code tree (the commit before the prompt-path change, and
the working tree), `evalpipe serve` (v4-top2 random bf16, cache on, the real job's flags) then `evalpipe bench` C64
and C16 and `evalpipe run gsm8k` 1,314 at C64; order base, new, new, base (ABBA)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.serving import gpu_real_job as rj
from tests.support.server_harness import ServerProcess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--base", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--order", default="base,new,new,base")
    ap.add_argument("--gsm8k-examples", type=int, default=1314)
    a = ap.parse_args()
    args = argparse.Namespace(
        bench_rounds=3, bench_client_processes=1, data_dir=a.data_dir, gsm8k_examples=a.gsm8k_examples, run_timeout=240
    )
    model_dir = a.out / "v4-top2"
    rj.write_checkpoint(model_dir, False)
    site = os.environ["PYTHONPATH"].split(":")[0]
    home, base = Path.cwd(), Path(a.base).resolve()
    a.out, a.data_dir, args.data_dir = a.out.resolve(), str(Path(a.data_dir).resolve()), str(Path(a.data_dir).resolve())
    model_dir = model_dir.resolve()
    results = []
    for i, spec in enumerate(a.order.split(",")):
        tree, _, delay = spec.partition(":")  # new:1 = this tree with --prefill-delay-factor 1
        # `python -m` puts the working folder first on sys.path: the server and clients run from the tree's folder
        os.chdir(base if tree == "base" else home)
        os.environ["PYTHONPATH"] = f"{site}:."
        label = f"{tree}{i}" + (f"-delay{delay}" if delay else "")
        t0 = time.perf_counter()
        extra = ["--prefill-delay-factor", delay] if delay else []
        srv = ServerProcess(*rj.serve_base(), "--prefix-cache", "on", *extra, model=str(model_dir))
        boot = time.perf_counter() - t0
        try:
            row = {"tree": tree, "label": label, "boot_s": round(boot, 1)}
            for c in (64, 16):
                r = rj.bench_arm(srv, a.out, c, "on", args, label)
                row[f"bench_c{c}"] = r.get("aggregate_tok_s")
            g = rj.gsm8k_arm(srv, a.out, label, args)
            g.pop("outputs")
            row["gsm8k"] = g
        finally:
            srv.stop()
            (a.out / f"serve-{label}.log").write_text(srv.output())
        results.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "http_ab.json").write_text(json.dumps(results, indent=1))
    print("| tree | bench C64 tok/s (median of 3) | bench C16 | gsm8k 1,314 wall s | errors |")
    for r in results:
        print(
            f"| {r['label']} | {(r['bench_c64'] or {}).get('median', 0):.0f} | "
            f"{(r['bench_c16'] or {}).get('median', 0):.0f} | "
            f"{r['gsm8k']['wall_s']} | {r['gsm8k']['errors']} |"
        )


if __name__ == "__main__":
    main()
