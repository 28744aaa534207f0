"""Before/after the engine's host-work change (1c81339) through HTTP on one GPU, one run: for each tree (this one,
`new`; and /tmp/base, this one with 1c81339 reversed), one `evalpipe serve` boot (v4-top2 random bf16, prefix cache
on), `evalpipe bench` C64 (3 rounds, 1 client process) and `evalpipe run gsm8k` 1,314 at C64.
The serve log's INFO lines time Engine.step apart for decode-only steps and steps with prompt chunks.

    python .gpu/host_ab.py --out DIR --base DIR --data-dir DIR [--order new,base]
"""

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
    ap.add_argument("--order", default="new,base")
    a = ap.parse_args()
    data = str(Path(a.data_dir).resolve())
    args = argparse.Namespace(
        bench_rounds=3, bench_client_processes=1, data_dir=data, gsm8k_examples=1314, run_timeout=240
    )
    a.out = a.out.resolve()
    model_dir = (a.out / "v4-top2").resolve()
    if not (model_dir / "config.json").exists():
        rj.write_checkpoint(model_dir, False)
    site = os.environ["PYTHONPATH"].split(":")[0]
    home, base = Path.cwd(), Path(a.base).resolve()
    results = []
    for i, tree in enumerate(a.order.split(",")):
        os.chdir(base if tree == "base" else home)  # `python -m` puts the working folder first on sys.path
        os.environ["PYTHONPATH"] = f"{site}:."
        label = f"{tree}{i}"
        t0 = time.perf_counter()
        srv = ServerProcess(*rj.serve_base(), "--prefix-cache", "on", model=str(model_dir))
        row = {"tree": tree, "label": label, "boot_s": round(time.perf_counter() - t0, 1)}
        try:
            row["bench_c64"] = rj.bench_arm(srv, a.out, 64, "on", args, label).get("aggregate_tok_s")
            print(json.dumps(row), flush=True)
            g = rj.gsm8k_arm(srv, a.out, label, args)
            g.pop("outputs")
            row["gsm8k"] = g
        finally:
            srv.stop()
            (a.out / f"serve-{label}.log").write_text(srv.output())
        row["engine_log"] = [ln.split("engine: ", 1)[-1] for ln in srv.output().splitlines() if "tok/s" in ln][-12:]
        results.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "host_ab.json").write_text(json.dumps(results, indent=1))
    print("| tree | bench C64 tok/s (median of 3) | gsm8k 1,314 wall s | errors |")
    for r in results:
        g = r.get("gsm8k", {})
        c64 = (r["bench_c64"] or {}).get("median", 0)
        print(f"| {r['label']} | {c64:.0f} | {g.get('wall_s')} | {g.get('errors')} |")


if __name__ == "__main__":
    main()
