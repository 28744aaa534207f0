"""One `evalpipe serve` boot of this tree (v4-top2 random bf16, cache on, --log-level info): `evalpipe bench` C64
with 1, 4 and 1 client processes (is the bench's own client a bound?), then `evalpipe run gsm8k` 1,314 at C64. The
serve log's windows time Engine.step apart for decode-only steps and steps with prompt chunks.

    python .gpu/served_probe.py --out DIR --data-dir DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.serving import gpu_real_job as rj
from tests.support.server_harness import ServerProcess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--clients", default="1,4,1")
    a = ap.parse_args()
    a.out = a.out.resolve()
    args = argparse.Namespace(
        bench_rounds=3,
        bench_client_processes=1,
        data_dir=str(Path(a.data_dir).resolve()),
        gsm8k_examples=1314,
        run_timeout=240,
    )
    model_dir = a.out / "v4-top2"
    if not (model_dir / "config.json").exists():
        rj.write_checkpoint(model_dir, False)
    srv = ServerProcess(*rj.serve_base(), "--prefix-cache", "on", model=str(model_dir.resolve()))
    row = {"bench_c64": []}
    try:
        for i, n in enumerate(int(x) for x in a.clients.split(",")):
            args.bench_client_processes = n
            r = rj.bench_arm(srv, a.out, 64, "on", args, f"clients{n}-{i}")
            row["bench_c64"].append(r)
            print(json.dumps(r), flush=True)
        g = rj.gsm8k_arm(srv, a.out, "served", args)
        g.pop("outputs")
        row["gsm8k"] = g
        print(json.dumps(g), flush=True)
    finally:
        srv.stop()
        (a.out / "serve-probe.log").write_text(srv.output())
    (a.out / "served_probe.json").write_text(json.dumps(row, indent=1))
    for line in srv.output().splitlines():
        if "generated tok/s" in line:
            print(line.split("engine: ", 1)[-1], flush=True)


if __name__ == "__main__":
    main()
