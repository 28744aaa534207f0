"""Where a prompt chunk's wall time goes on the GPU (v4-top2 random weights): prefill rate per chunk size, the
host<->device synchronisations one chunk makes (torch.cuda.set_sync_debug_mode, with the evalpipe frames that
caused each), a cProfile of one chunk, and the MoE of prompt chunks through the engine's kernels vs grouped GEMMs."""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks.serving import gpu_real_job as rj
from evalpipe.engine.engine import Engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.kernels.moe import moe_forward


def seqs(n, length, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        Sequence(
            prompt=torch.randint(16, 272, (length,), generator=gen).tolist(),
            params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        for _ in range(n)
    ]


def rate(runner, tok, chunk, n=8, length=3500):
    engine = Engine(runner, tok, max_batch=64, max_tokens_per_step=chunk)
    ss = seqs(n, length, chunk)
    engine.submit(ss)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while any(s.status is not Status.FINISHED for s in ss):
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return n * length / wall, steps, wall, engine


def probe_syncs(engine, chunk):
    (s,) = seqs(1, chunk + 1, 99)
    engine.submit([s])
    sites = collections.Counter()
    old = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/evalpipe/" in f.filename]
        key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in frames[-4:][::-1])
        sites[f"{str(message)[:60]} @ {key}"] += 1

    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode(1)
    try:
        engine.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    torch.cuda.synchronize()
    print(f"  syncs in one {chunk}-row chunk step: {sum(sites.values())}")
    for k, v in sites.most_common(40):
        print(f"    {v:4d} x {k}")
    while s.status is not Status.FINISHED:
        engine.step()
    (s,) = seqs(1, chunk + 1, 98)
    engine.submit([s])
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    engine.step()
    torch.cuda.synchronize()
    pr.disable()
    print(f"  cProfile of one {chunk}-row chunk step ({(time.perf_counter() - t0) * 1e3:.1f} ms wall, profiled):")
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    print("\n".join("    " + ln for ln in buf.getvalue().splitlines()[:48]))
    while s.status is not Status.FINISHED:
        engine.step()


def main():
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    model_dir = out / "v4-top2"
    t0 = time.perf_counter()
    params = rj.write_checkpoint(model_dir, False)
    print(f"{torch.cuda.get_device_name()}: checkpoint {params / 1e9:.3f} B params in {time.perf_counter() - t0:.1f}s")
    tok = load_tokenizer(None)
    runner, build_s = rj.server_runner(model_dir)
    print(f"runner built in {build_s:.1f}s")
    model = runner.eager_runner.model if hasattr(runner, "eager_runner") else runner.model
    arms = sys.argv[2].split(",") if len(sys.argv) > 2 else ["grouped (default)", "kernels.moe"]
    for label in arms:
        if label == "kernels.moe":
            model._eager_moe = lambda moe, x, ids: moe_forward(moe, x, ids, backend="auto", invariant=False)
        print(f"== prompt-chunk MoE: {label}")
        for chunk in (2048, 8192):
            r, steps, wall, engine = rate(runner, tok, chunk)
            r2, _, _, _ = rate(runner, tok, chunk)
            print(f"  prefill chunk {chunk}: {r:.0f} / {r2:.0f} tok/s ({steps} steps, {wall:.2f}s)", flush=True)
        probe_syncs(engine, 2048)


if __name__ == "__main__":
    main()
