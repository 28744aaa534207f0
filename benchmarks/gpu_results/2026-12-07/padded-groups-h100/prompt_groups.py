"""What a GSM8K-shaped prompt step costs, by how many attention groups it carries: K prompts that each continue
a PREFIX-token context by ~CHUNK rows (what the served GSM8K job's prompt steps feed after a prefix cache hit), as
one eager forward through the server's runner. Arms: K chunks of K distinct lengths as one padded group (the
tree's rule), the same as K groups (one per distinct length: the rule before, `group_requests` replaced), and K
chunks of one length. Per arm, per trial: wall (host clock around a synchronised forward), then one profiled
forward (kernels launched, GPU busy), and a cProfile of the first two arms.

    python .gpu/prompt_groups.py OUT [--k 12] [--prefix 2176] [--chunk 300] [--trials 3] [--smoke]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

from benchmarks.serving import gpu_real_job as rj
from benchmarks.serving.gpu_serving import count_kernels
from evalpipe.engine import forward_batch

PADDED = forward_batch.group_requests


def one_group_per_count(counts):
    by: dict[int, list[int]] = {}
    for i, c in enumerate(counts):
        by.setdefault(c, []).append(i)
    return list(by.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--k", type=int, default=12)
    ap.add_argument("--prefix", type=int, default=2176)
    ap.add_argument("--chunk", type=int, default=300)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if rj.place("prompt_groups", a.smoke) is None:
        return
    if a.smoke:
        a.prefix, a.chunk, a.k, a.trials = 64, 20, 3, 1
    model_dir = a.out / "v4-top2"
    if not (model_dir / "config.json").exists():
        rj.write_checkpoint(model_dir, a.smoke)
    runner, built = rj.server_runner(model_dir)
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}: runner in {built:.1f}s", flush=True)
    gen = torch.Generator().manual_seed(0)
    K = a.k
    spread = [a.chunk - 4 * K + 8 * i for i in range(K)]  # e.g. 252..340
    arms = {
        f"{K} lengths, padded group": (spread, PADDED),
        f"{K} lengths, {K} groups": (spread, one_group_per_count),
        f"{K} chunks, one length": ([a.chunk] * K, PADDED),
        "1 chunk": ([a.chunk], PADDED),
    }

    def prepared(counts):
        seqs = [runner.allocate() for _ in counts]
        for s in seqs:
            for i in range(0, a.prefix, 2048):
                runner.forward([s], [torch.randint(16, 272, (min(2048, a.prefix - i),), generator=gen).tolist()])
        chunks = [torch.randint(16, 272, (c,), generator=gen).tolist() for c in counts]
        rj.sync()
        return seqs, chunks

    def done(seqs):
        for s in seqs:
            runner.free(s)

    for trial in range(a.trials + 1):  # trial 0: warm-up (compiles each arm's kernels)
        for name, (counts, rule) in arms.items():
            forward_batch.group_requests = rule
            seqs, chunks = prepared(counts)
            t0 = time.perf_counter()
            runner.forward(seqs, chunks, prompt_chunks=len(seqs))
            rj.sync()
            wall = time.perf_counter() - t0
            done(seqs)
            if trial:
                print(f"  trial {trial}: {name:24s} {sum(counts):5d} rows: {wall * 1e3:8.2f} ms wall", flush=True)
    for name, (counts, rule) in arms.items():
        forward_batch.group_requests = rule
        seqs, chunks = prepared(counts)
        k = count_kernels(lambda: runner.forward(seqs, chunks, prompt_chunks=len(seqs)), top=10)
        done(seqs)
        print(f"  profiled: {name}: {k}", flush=True)
    for name, (counts, rule) in [*list(arms.items())[:2], list(arms.items())[-1]]:
        forward_batch.group_requests = rule
        seqs, chunks = prepared(counts)
        prof = cProfile.Profile()
        prof.enable()
        runner.forward(seqs, chunks, prompt_chunks=len(seqs))
        rj.sync()
        prof.disable()
        done(seqs)
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        print(f"  cProfile of {name}:\n{s.getvalue()}", flush=True)
    forward_batch.group_requests = PADDED


if __name__ == "__main__":
    main()
