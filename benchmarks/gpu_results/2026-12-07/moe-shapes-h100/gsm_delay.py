"""`evalpipe run gsm8k` 1,314 at C64 through `evalpipe serve` (v4-top2 random bf16, cache on, the real job's flags)
with each --prefill-delay-factor given, one boot each; from each server's own log (--log-level info), the steps,
the steps with prompt chunks and their prompt rows, summed over its windows.

    python .gpu/gsm_delay.py --out DIR --data-dir DATA [--factors 0,1]
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from benchmarks.serving import gpu_real_job as rj
from tests.support.server_harness import ServerProcess

WINDOW = re.compile(
    r"last ([\d.]+) s: (\d+) steps \((\d+) overlapped, (\d+) with prompt chunks, ([\d.]+) prompt rows each\)"
)


def engine_counts(log: str) -> dict:
    wall = steps = overlapped = chunked = rows = 0.0
    for m in WINDOW.finditer(log):
        w, s, o, c, r = (float(x) for x in m.groups())
        wall, steps, overlapped, chunked, rows = wall + w, steps + s, overlapped + o, chunked + c, rows + c * r
    return {"steps": int(steps), "overlapped": int(overlapped), "prompt_steps": int(chunked), "prompt_rows": int(rows)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--factors", default="0,1")
    ap.add_argument("--gsm8k-examples", type=int, default=1314)
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny config (a dry run)")
    a = ap.parse_args()
    rj.place("gsm_delay", a.smoke)
    args = argparse.Namespace(data_dir=a.data_dir, gsm8k_examples=a.gsm8k_examples, run_timeout=240)
    model_dir = a.out / "v4-top2"
    if not (model_dir / "config.json").exists():  # the same seeded weights as another script's
        rj.write_checkpoint(model_dir, a.smoke)
    rows = []
    for i, factor in enumerate(a.factors.split(",")):
        label = f"delay{factor}-{i}"
        t0 = time.perf_counter()
        srv = ServerProcess(
            *rj.serve_base(), "--prefix-cache", "on", "--prefill-delay-factor", factor, model=str(model_dir)
        )
        boot = time.perf_counter() - t0
        try:
            g = rj.gsm8k_arm(srv, a.out, label, args)
            g.pop("outputs")
        finally:
            srv.stop()
            log = srv.output()
            (a.out / f"serve-{label}.log").write_text(log)
        row = {"factor": float(factor), "label": label, "boot_s": round(boot, 1), **g, **engine_counts(log)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    (a.out / "gsm_delay.json").write_text(json.dumps(rows, indent=1))
    print("| --prefill-delay-factor | gsm8k wall s | errors | engine steps | with prompt chunks | prompt rows |")
    for r in rows:
        print(
            f"| {r['factor']:g} | {r['wall_s']:.2f} | {r['errors']} | {r['steps']} | {r['prompt_steps']} | "
            f"{r['prompt_rows']} |"
        )


if __name__ == "__main__":
    main()
