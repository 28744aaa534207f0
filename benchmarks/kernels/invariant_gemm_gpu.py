"""Where `--deterministic` loses its C64 decode rate, and which batch-invariant GEMM tile wins it back.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python -m benchmarks.kernels.invariant_gemm_gpu [--steps 8] [--reps 50]

1. Profile: `benchmarks/serving/gpu_serving.py`'s v4-top2 (random bf16 weights), one engine per mode built as the
   server builds it (CUDA graphs for every bucket), 64 greedy sequences of 128-token prompts decoding; torch.profiler
   over `--steps` steady engine steps. Per mode: device time per step and its kernels grouped by name, largest first.
2. GEMM shapes: every [B, M, K] @ [B, K, N] the deterministic engine launched through kernels/batch_invariant while
   it captured its graphs, with how often each (B, K, N, weight layout) runs in the 64-row step.
3. Tile sweep: each shape at M = 64 timed (CUDA-graph replays of 20 launches, median of 5) with the tile
   `tile_for(N, K)` picks now, with every candidate tile (block_n x block_k x warps/stages x split_k), and through
   cuBLAS (torch.matmul, not batch-invariant: the speed a tile could reach). Candidates keep rows invariant by
   construction (no choice depends on M); `tests/kernels/test_batch_invariant.py` checks that for split tiles.
A table per part; every number also in `OUT/invariant_gemm.json`. `--smoke`: CPU, the tiny config, float32: the
checkpoint and the (empty) tables only, as the overrides act on CUDA tensors.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.serving import gpu_real_job
from benchmarks.serving.deterministic_gpu import engine_for, release
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.kernels import batch_invariant as bi

CANDIDATES = [
    bi.Tile(block_n=bn, block_k=bk, num_warps=w, num_stages=st, split_k=sk)
    for bn in (32, 64, 128)
    for bk in (128, 256)
    for w, st in ((4, 3), (8, 3))
    for sk in (1, 2, 4, 8, 16)
    if bn * bk <= 16384
]


def decoding_engine(model_dir: Path, device: str, dtype: str, deterministic: bool, batch: int = 64):
    """An engine with `batch` greedy sequences past their prompts (128 random tokens each), decoding."""
    engine = engine_for(model_dir, device, dtype, deterministic=deterministic, prefix_cache="off")
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    seqs = [
        Sequence(prompt=torch.randint(16, 272, (128,), generator=gen).tolist(), params=params) for _ in range(batch)
    ]
    engine.submit(seqs)
    while any(s.prefilling or s.status is Status.WAITING for s in seqs):
        engine.step()
    for _ in range(4):
        engine.step()
    return engine


def profile_steps(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    by_name: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name[:70]
            by_name[name][0] += e.device_time / steps  # us
            by_name[name][1] += 1
    kernels = sorted(([n, round(us, 1), c // steps] for n, (us, c) in by_name.items()), key=lambda r: -r[1])
    return {"wall_ms": round(wall_ms, 3), "device_us": round(sum(r[1] for r in kernels), 1), "kernels": kernels}


def time_us(fn, reps: int) -> float:
    """Median of 5 timings of a CUDA graph that runs fn `reps` times, per run."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def sweep(shape: tuple, reps: int) -> dict:
    """One recorded shape (B, K, N, weight transposed?) at M = 64: cuBLAS, today's tile, every candidate."""
    B, K, N, transposed = shape
    a = torch.randn(B, 64, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, N, K, device="cuda", dtype=torch.bfloat16) if transposed else None
    b = w.transpose(1, 2) if transposed else torch.randn(B, K, N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty(B, 64, N, device="cuda", dtype=torch.bfloat16)
    res = {"cublas_us": round(time_us(lambda: torch.matmul(a, b), reps), 2)}
    now = bi.tile_for(N, K)
    res["now"] = [now.__dict__, round(time_us(lambda: bi.launch_matmul(a, b, c, None, now), reps), 2)]
    tried = []
    for tile in CANDIDATES:
        try:
            tried.append([tile.__dict__, round(time_us(lambda t=tile: bi.launch_matmul(a, b, c, None, t), reps), 2)])
        except Exception as exc:  # a tile that does not compile or fit: recorded, not fatal
            tried.append([tile.__dict__, f"{type(exc).__name__}: {str(exc)[:80]}"])
    timed = [t for t in tried if isinstance(t[1], float)]
    res["best"] = min(timed, key=lambda t: t[1]) if timed else None
    res["top5"] = sorted(timed, key=lambda t: t[1])[:5]
    res["weight_mb"] = round(B * K * N * 2 / 1e6, 2)
    return res


def record_shapes(model_dir: Path, device: str, dtype: str) -> collections.Counter:
    """(B, M, K, N, weight transposed?) of every batch_invariant launch while a deterministic engine is built."""
    seen: collections.Counter = collections.Counter()
    launch = bi.launch_matmul

    def recording(a3, b3, c3, bias, tile):
        seen[(a3.shape[0], a3.shape[1], a3.shape[2], b3.shape[2], b3.stride(1) == 1)] += 1
        return launch(a3, b3, c3, bias, tile)

    bi.launch_matmul = recording
    try:
        release(engine_for(model_dir, device, dtype, deterministic=True, prefix_cache="off"))
    finally:
        bi.launch_matmul = launch
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "invariant-gemm"), help="folder for the JSON report")
    ap.add_argument("--steps", type=int, default=8, help="profiled decode steps per mode")
    ap.add_argument("--reps", type=int, default=20, help="launches per timed graph in the sweep")
    ap.add_argument("--no-profile", action="store_true", help="skip part 1 (the two engines' decode profiles)")
    ap.add_argument("--no-sweep", action="store_true", help="skip parts 2 and 3 (the GEMM shapes and the tile sweep)")
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, tiny config, float32: checkpoint and empty tables (a dry run)"
    )
    args = ap.parse_args()
    placed = gpu_real_job.place("invariant_gemm_gpu", args.smoke)
    if placed is None:
        return 2
    device, dtype = placed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict = {"argv": sys.argv}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    model_dir = Path(tempfile.mkdtemp(prefix="v4-top2-")) / "model"
    report["parameters"] = gpu_real_job.write_checkpoint(model_dir, args.smoke)
    log(f"checkpoint {report['parameters'] / 1e9:.3f} B parameters")
    if device == "cuda" and not args.no_profile:
        for mode in ("default", "deterministic"):
            engine = decoding_engine(model_dir, device, dtype, mode == "deterministic")
            report[mode] = profile_steps(engine, args.steps)
            log(f"{mode}: {report[mode]['wall_ms']} ms per step, {report[mode]['device_us']} us of kernels")
            release(engine)
            (out / "invariant_gemm.json").write_text(json.dumps(report, indent=2))
    if args.no_sweep:
        report["shapes"] = []
        print_tables(report)
        return 0
    # the overrides act on CUDA tensors only: on the CPU (--smoke) an engine build would record nothing
    shapes = record_shapes(model_dir, device, dtype) if device == "cuda" else collections.Counter()
    step_shapes = collections.Counter()
    for (B, M, K, N, tr), n in shapes.items():
        if M == 64 or device == "cpu":
            step_shapes[(B, K, N, tr)] += n
    report["shapes"] = [[list(s), n] for s, n in step_shapes.most_common()]
    log(f"{len(step_shapes)} GEMM shapes at M=64")
    if device == "cuda":
        report["sweep"] = []
        for shape, n in step_shapes.most_common():
            res = sweep(shape, args.reps)
            res["shape"], res["calls"] = list(shape), n
            report["sweep"].append(res)
            log(f"  {shape} x{n}: cuBLAS {res['cublas_us']} us, now {res['now'][1]} us, best {res['best']}")
            (out / "invariant_gemm.json").write_text(json.dumps(report, indent=2))
    (out / "invariant_gemm.json").write_text(json.dumps(report, indent=2))
    print_tables(report)
    return 0


def print_tables(report: dict) -> None:
    for mode in ("default", "deterministic"):
        if mode in report:
            r = report[mode]
            print(f"\n{mode}: {r['wall_ms']} ms per step, {r['device_us']} us of kernels per step")
            print("| kernel | us per step | launches |\n|---|---:|---:|")
            for name, us, count in r["kernels"][:14]:
                print(f"| {name} | {us} | {count} |")
    print("\n| GEMM (B, K, N, transposed) | calls | MB | cuBLAS us | now us | best us | best tile |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for res in report.get("sweep", []):
        best = res["best"] or [{}, "-"]
        print(
            f"| {tuple(res['shape'])} | {res['calls']} | {res['weight_mb']} | {res['cublas_us']} | {res['now'][1]} "
            f"| {best[1]} | {best[0]} |"
        )
    if "sweep" not in report:
        for shape, n in report["shapes"]:
            print(f"| {tuple(shape)} | {n} | - | - | - | - | - |")


if __name__ == "__main__":
    sys.exit(main())
