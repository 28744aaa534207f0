"""Decode throughput of the native engine's ModelRunner vs transformers `generate`, same weights, same process.

Rows: transformers generate at batch 1 (cached greedy decode), the runner at batch 1, and the runner's aggregate
throughput with 64 concurrent sequences (one batched forward of 64 decode rows per step). Decode only: prefill is
done before the clock starts (for generate: time(prompt + N new) - time(prompt + 1 new)).

    python benchmarks/engine_cpu.py [--model PATH] [--new-tokens 64] [--prompt-len 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def bench_generate(model, prompt: list[int], new_tokens: int, repeats: int) -> float:
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def timed(n):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        assert out.shape[1] == len(prompt) + n
        return time.perf_counter() - t

    timed(2)  # warm-up
    samples = [(timed(new_tokens + 1) - timed(1)) for _ in range(repeats)]
    return new_tokens / statistics.median(samples)


def bench_runner(runner, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        seqs = [runner.allocate() for _ in prompts]
        logits = runner.forward(seqs, prompts)
        nxt = [[int(t)] for t in logits.argmax(-1)]
        logits = runner.forward(seqs, nxt)  # warm-up step
        nxt = [[int(t)] for t in logits.argmax(-1)]
        t = time.perf_counter()
        for _ in range(new_tokens):
            logits = runner.forward(seqs, nxt)
            nxt = [[int(t)] for t in logits.argmax(-1)]
        rates.append(len(seqs) * new_tokens / (time.perf_counter() - t))
        for s in seqs:
            runner.free(s)
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the seeded evalpipe-tiny-dsv4)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode steps timed per measurement")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens before decoding starts")
    ap.add_argument("--concurrency", type=int, default=64, help="sequences decoded together for the aggregate row")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per row (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (same for both engines)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import DeepseekV4ForCausalLM

    from evalpipe.engine.runner import ModelRunner

    runner = ModelRunner(args.model, max_seqs=args.concurrency, max_seq_len=args.prompt_len + args.new_tokens + 16)
    hf = DeepseekV4ForCausalLM.from_pretrained(runner.model_path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(16, 272, (n,), generator=gen).tolist()

    base = prompt(args.prompt_len)
    hf_tps = bench_generate(hf, base, args.new_tokens, args.repeats)
    r1 = bench_runner(runner, [base], args.new_tokens, args.repeats)
    lens = [max(1, args.prompt_len + (i % 17) - 8) for i in range(args.concurrency)]
    r64 = bench_runner(runner, [prompt(n) for n in lens], args.new_tokens, args.repeats)

    rows = [
        ("transformers generate", 1, hf_tps),
        ("evalpipe ModelRunner", 1, r1),
        ("evalpipe ModelRunner", args.concurrency, r64),
    ]
    print(f"\nmodel {runner.model_name} ({runner.describe()['parameters'] / 1e6:.2f}M params), float32, "
          f"cpu threads {args.threads}, prompt {args.prompt_len}, {args.new_tokens} decode steps, "
          f"median of {args.repeats}")
    print(f"{'engine':<24}{'batch':>6}{'decode tok/s':>14}{'vs transformers b1':>20}")
    for name, batch, tps in rows:
        print(f"{name:<24}{batch:>6}{tps:>14.1f}{tps / hf_tps:>19.1f}x")
    print(f"targets: runner b1 > transformers b1 ({r1 / hf_tps:.1f}x); "
          f"runner b{args.concurrency} aggregate >= 8x ({r64 / hf_tps:.1f}x)")


if __name__ == "__main__":
    main()
