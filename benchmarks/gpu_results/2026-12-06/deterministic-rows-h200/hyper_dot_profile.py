"""The default C64 decode step (invariant_gemm_gpu's engine and profile) with merge/mix as GEMM tiles at 64 rows:
one engine per (DOT_ROWS, DOT_SUB, DOT_WARPS) arm given on the command line as rows,sub,warps."""

import json
import sys
import tempfile
from pathlib import Path

from benchmarks.kernels import invariant_gemm_gpu as ig
from benchmarks.serving import gpu_real_job
from benchmarks.serving.deterministic_gpu import release
from evalpipe.kernels import hyper

out = Path(sys.argv[1])
device, dtype = gpu_real_job.place("hyper_dot_profile", False)
model_dir = Path(tempfile.mkdtemp(prefix="v4-top2-")) / "model"
gpu_real_job.write_checkpoint(model_dir, False)
report = {}
for arm in sys.argv[2:]:
    rows, sub, warps = (int(v) for v in arm.split(","))
    hyper.DOT_MIN_ROWS, hyper.DOT_ROWS, hyper.DOT_SUB, hyper.DOT_WARPS = (16 if rows else 128), rows or 32, sub, warps
    engine = ig.decoding_engine(model_dir, device, dtype, False)
    r = ig.profile_steps(engine, 16)
    release(engine)
    report[arm] = r
    mix = [k for k in r["kernels"] if "merge_mix" in k[0]]
    print(
        f"arm rows,sub,warps={arm} (DOT_MIN_ROWS {hyper.DOT_MIN_ROWS}): {r['wall_ms']} ms per step, "
        f"{r['device_us']} us of kernels; merge/mix {mix}",
        flush=True,
    )
    print("  top:", r["kernels"][:8], flush=True)
(out / "hyper_dot_profile.json").write_text(json.dumps(report, indent=2))
