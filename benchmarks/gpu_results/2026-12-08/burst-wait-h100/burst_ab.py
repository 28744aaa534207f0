"""`evalpipe serve --burst-wait-ms` through HTTP on one GPU, one run: for each arm (a burst wait in ms, and
optionally a prefill delay factor), one `evalpipe serve` boot of this tree (v4-top2 random bf16, prefix cache on),
`evalpipe bench` C64 (3 rounds, 1 client process), with `--c1` also C1, and `evalpipe run gsm8k` 1,314 at C64
(`--gsm8k 0` leaves it out). The serve log's INFO lines time Engine.step apart for decode-only
steps and steps with prompt chunks, and count the prompt steps.

    python .gpu/burst_ab.py --out DIR --data-dir DIR [--arms 0,5,5:0.25] [--c1] [--gsm8k 0]

An arm is MS (--burst-wait-ms MS) or MS:F (and --prefill-delay-factor F).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.serving import gpu_real_job as rj
from tests.support.server_harness import ServerProcess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--arms", default="0,2,5,0")
    ap.add_argument("--gsm8k", type=int, default=1314)
    ap.add_argument("--c1", action="store_true", help="also `evalpipe bench` C1 (3 rounds)")
    a = ap.parse_args()
    data = str(Path(a.data_dir).resolve())
    args = argparse.Namespace(
        bench_rounds=3, bench_client_processes=1, data_dir=data, gsm8k_examples=a.gsm8k, run_timeout=240
    )
    a.out = a.out.resolve()
    model_dir = (a.out / "v4-top2").resolve()
    if not (model_dir / "config.json").exists():
        rj.write_checkpoint(model_dir, False)
    results = []
    for i, arm in enumerate(a.arms.split(",")):
        ms, _, pdf = arm.partition(":")  # "MS" or "MS:F" (F: --prefill-delay-factor)
        label = f"burst{ms}-pdf{pdf or 0}-{i}"
        extra = ["--prefill-delay-factor", pdf] if pdf else []
        t0 = time.perf_counter()
        srv = ServerProcess(
            *rj.serve_base(), "--prefix-cache", "on", "--burst-wait-ms", ms, *extra, model=str(model_dir)
        )
        row = {"burst_wait_ms": float(ms), "prefill_delay_factor": float(pdf or 0), "label": label}
        row["boot_s"] = round(time.perf_counter() - t0, 1)
        try:
            row["bench_c64"] = rj.bench_arm(srv, a.out, 64, "on", args, label).get("aggregate_tok_s")
            if a.c1:
                row["bench_c1"] = rj.bench_arm(srv, a.out, 1, "on", args, label).get("aggregate_tok_s")
            print(json.dumps(row), flush=True)
            if a.gsm8k:
                g = rj.gsm8k_arm(srv, a.out, label, args)
                g.pop("outputs")
                row["gsm8k"] = g
        finally:
            srv.stop()
            (a.out / f"serve-{label}.log").write_text(srv.output())
        row["engine_log"] = [ln.split("engine: ", 1)[-1] for ln in srv.output().splitlines() if "tok/s" in ln][-12:]
        results.append(row)
        print(json.dumps(row), flush=True)
        (a.out / "burst_ab.json").write_text(json.dumps(results, indent=1))
    print("| arm | bench C64 tok/s (median of 3) | rounds | gsm8k 1,314 wall s | errors |")
    for r in results:
        g = r.get("gsm8k", {})
        c64 = r["bench_c64"] or {}
        print(f"| {r['label']} | {c64.get('median', 0):.0f} | {c64} | {g.get('wall_s')} | {g.get('errors')} |")
        if r.get("bench_c1"):
            print(f"|   C1: {r['bench_c1']} |")


if __name__ == "__main__":
    main()
