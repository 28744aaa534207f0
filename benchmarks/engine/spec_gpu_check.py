"""Block speculation on CUDA through the captured, fused verify step (GraphRunner, fused=True: ratio2_compress_verify on
the ratio-2 layers, q_rope_store): greedy spec-on tokens equal plain greedy decoding for several drafters and block
sizes, the self drafter accepts every draft, seeded sampling runs and repeats. Prints one line per case.

    python -m benchmarks.engine.spec_gpu_check [--new-tokens 48] [--smoke]
"""

from __future__ import annotations

import argparse
import time

import torch

from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.static.graphs import GraphRunner
from tests.support.spec_helpers import compare_with_tie_rule, finish, start


def plain(target, prompts, new_tokens):
    """Plain greedy decoding of all prompts as one batch (decode width 1: the captured decode step)."""
    seqs = start(target, prompts)
    margins = [[] for _ in seqs]
    while len(seqs[0].output) < new_tokens:
        logits = target.forward([s.slot for s in seqs], [[s.output[-1]] for s in seqs])
        for s, row, m in zip(seqs, logits, margins):
            top2 = torch.topk(row.double(), 2).values
            m.append(float(top2[0] - top2[1]))
            s.output.append(int(row.argmax()))
    out = [(s.output[:new_tokens], [0.0] + m) for s, m in zip(seqs, margins)]
    for s in seqs:
        target.free(s.slot)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check on the CPU: the static step un-captured, 4 tokens, G=2, the ngram drafter",
    )
    args = ap.parse_args()
    device, blocks, drafters, sampled_steps = "cuda", (2, 5, 9), ("layerskip:3", "ngram", "self"), 8
    if args.smoke:
        device, blocks, drafters, sampled_steps = "cpu", (2,), ("ngram",), 1
        args.new_tokens = 4
    else:
        assert torch.cuda.is_available(), "needs CUDA"
    base = ModelRunner(device=device, max_seqs=16, max_seq_len=512)
    target = GraphRunner(base, widths=(1,) + tuple(g + 1 for g in blocks), fused=True)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(16, 272, (n,), generator=gen).tolist() for n in (30, 5, 41, 64)]
    ref = plain(target, prompts, args.new_tokens)
    failures = 0
    # the captured decode step against the eager runner (no graph, no fused kernels): plain greedy must agree
    eager = plain(base, prompts, args.new_tokens)
    for i in range(len(prompts)):
        try:
            print("captured vs eager plain decoding:", compare_with_tie_rule(ref[i][0], *eager[i], f"p{i}"))
        except AssertionError as exc:
            failures += 1
            print(f"FAIL captured vs eager plain decoding: {exc}")
    rows = []  # (drafter, G, accepted-drafts histogram, seconds)
    for drafter_name in drafters:
        drafter = build_drafter(drafter_name, target)
        for block in blocks:
            decoder = SpeculativeDecoder(target, drafter, block_size=block)
            t = time.perf_counter()
            seqs = start(target, prompts)
            active = list(seqs)
            while active:
                decoder.verify_step(active)
                active = [s for s in active if len(s.output) < args.new_tokens]
            secs = time.perf_counter() - t
            for i, s in enumerate(seqs):
                try:
                    line = compare_with_tie_rule(s.output[: args.new_tokens], *ref[i], f"{drafter_name} G={block} p{i}")
                except AssertionError as exc:
                    failures += 1
                    line = f"FAIL {exc}"
                    try:  # which side moved: the spec output against the eager runner's greedy tokens
                        line += "; vs eager: " + compare_with_tie_rule(s.output[: args.new_tokens], *eager[i], "spec")
                    except AssertionError as exc2:
                        line += f"; vs eager: {exc2}"
                if "equal" not in line:
                    print(line)
            hist = [sum(h) for h in zip(*(decoder.stats(s)["accept_histogram"] for s in seqs))]
            if drafter_name == "self" and hist[block] != sum(hist):
                failures += 1
                print(f"FAIL self drafter G={block}: histogram {hist}")
            print(f"{drafter_name:<12} G={block}: lossless check done, accepted-drafts histogram {hist}, {secs:.2f}s")
            rows.append((drafter_name, block, hist, secs))
            finish(target, decoder, seqs)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=3, max_tokens=1 << 20)
    outs = []
    for _ in range(2):
        decoder = SpeculativeDecoder(target, build_drafter("layerskip:3", target), block_size=5)
        seqs = start(target, prompts, params, seeds=[100 + i for i in range(len(prompts))])
        for _ in range(sampled_steps):
            decoder.verify_step(seqs)
        outs.append([list(s.output[1:]) for s in seqs])
        finish(target, decoder, seqs)
    same = outs[0] == outs[1]
    failures += not same
    print(f"sampled (T=0.8, top_p 0.95, top_k 40) on {device}: seeded runs repeat: {same}")
    print(f"graph steps captured: {target.describe()['cuda_graphs']}")
    print("\n| drafter | G | accepted-drafts histogram | seconds |\n|---|---:|---|---:|")
    for drafter_name, block, hist, secs in rows:
        print(f"| {drafter_name} | {block} | {hist} | {secs:.2f} |")
    print("RESULT:", "all checks passed" if not failures else f"{failures} failure(s)")


if __name__ == "__main__":
    main()
