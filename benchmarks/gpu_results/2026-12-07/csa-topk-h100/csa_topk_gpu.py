"""The CSA top-k of the server's step: `kernels.indexer.csa_topk` against the chain it replaced (visibility mask,
`causal_topk`: torch's radix sort and the index ops around it), checked exactly and timed.

    PYTHONPATH=. python -m benchmarks.kernels.csa_topk_gpu [--replays 50]
    PYTHONPATH=. python -m benchmarks.kernels.csa_topk_gpu --smoke     # CPU: TRITON_INTERPRET=1, small shapes

Shapes: the v4-top2 step's (E = 2,048 entries: 8,192 positions at ratio 4, the static step's fixed width; k = 512),
T rows of 64 (a C64 decode step) and 512 (C64 with 8-row verify blocks), every row seeing the first L entries for L
from a 128-token context to a full one. Scores are rounded to one decimal (exact ties), a tenth of the entries
dropped by the keep mask, -inf past L (as the indexer writes them). Each case: the kernel's output equal to the
chain's (`torch.equal`), then both captured in a CUDA graph and replayed (median of event-timed replays). One table:
T, L, chain us, kernel us, ratio. Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=50, help="timed graph replays per case (median reported)")
    ap.add_argument("--smoke", action="store_true", help="CPU dry run: the interpreter, small shapes, no timing")
    return ap.parse_args(argv)


def case(T: int, E: int, L: int, seed: int, device: str):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(T, E, generator=gen, device=device).round(decimals=1)
    keep = torch.rand(T, E, generator=gen, device=device) > 0.1
    lens = torch.full((T,), L, device=device, dtype=torch.long)
    visible = torch.arange(E, device=device)[None] < lens[:, None]
    return scores.masked_fill(~(visible & keep), float("-inf")), keep, lens


def main(argv=None) -> int:
    args = parse(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from benchmarks import gpu_bench
    from evalpipe.kernels.indexer import csa_topk

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("csa_topk_gpu: no CUDA device (--smoke runs a CPU dry run)", file=sys.stderr)
        return 2
    E, k = (96, 24) if args.smoke else (2048, 512)
    rows = (4,) if args.smoke else (64, 512)
    lens = (8, 40, 96) if args.smoke else (32, 256, 875, 2048)
    table, failed = [], 0
    for T in rows:
        for L in lens:
            scores, keep, lens_t = case(T, E, L, seed=T * 10_000 + L, device=device)
            got = csa_topk(scores, keep, lens_t, k, backend="triton")
            want = csa_topk(scores, keep, lens_t, k, backend="reference")
            same = torch.equal(got, want)
            failed += not same
            chain_us = kernel_us = float("nan")
            if device == "cuda":
                chain_us = gpu_bench.replay_us(
                    gpu_bench.capture(lambda: csa_topk(scores, keep, lens_t, k, backend="reference")), args.replays
                )
                kernel_us = gpu_bench.replay_us(
                    gpu_bench.capture(lambda: csa_topk(scores, keep, lens_t, k, backend="triton")), args.replays
                )
            table.append((T, L, chain_us, kernel_us, same))
    print(f"E {E}, k {k}" + ("" if args.smoke else f", {torch.cuda.get_device_name()}"))
    print("| T | L (visible entries) | chain us | kernel us | kernel / chain | equal |")
    print("|---:|---:|---:|---:|---:|---|")
    for T, L, chain_us, kernel_us, same in table:
        print(f"| {T} | {L} | {chain_us:.1f} | {kernel_us:.1f} | {kernel_us / chain_us:.2f} | {same} |")
    if failed:
        print(f"FAILED: {failed} case(s) where the kernel's picks differ from the chain's", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
