"""Block speculation on the CPU: a model (default: the trained evalpipe-skills-dsv4) at batch 1 and at N concurrent
requests, speculation off vs layerskip vs ngram vs self vs simulated acceptance, side by side in one run.

Each row drives the real engine loop (scheduler, batched drafting, one verify forward, acceptance, rollback, stop
checks) in process, greedy, `ignore_eos`, every request generating exactly --new-tokens tokens. tok/s is completion
tokens over wall time from submit to the last finish (prefill included, same for every row); accept length is the
server-wide completion tokens / verify steps; speedup is against "off" at the same concurrency. The accepted-draft
histogram per drafter is printed below the table.

    python -m benchmarks.engine.spec_cpu [--model evalpipe-tiny-dsv4] [--new-tokens 64] [--block-size 5]
        [--concurrency 1 16]

Prompts: held-out `arith` lane items as completions (the default model's own task), or --prompts gsm8k (GSM8K
questions through the chat template, the workload of the random tiny model's earlier measurements).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from evalpipe.engine.engine import Engine
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import make_sequences
from evalpipe.engine.spec.decoder import SpeculativeDecoder, default_drafter
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.tokenizer import load_tokenizer


def load_prompts(tokenizer, count: int, kind: str = "arith") -> list[list[int]]:
    """`arith`: held-out lane items as completion prompts; `gsm8k`: GSM8K questions (chat template, last 96
    tokens) when the shared data is there, else fixed sentences."""
    if kind == "arith":
        from evalpipe.lanes import get_lane

        return [tokenizer.encode_prompt(it.prompt) for it in get_lane("arith").items()[:count]]
    data = Path(os.environ.get("EVALPIPE_DATA_DIR", Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))
    path = data / "gsm8k" / "test.jsonl"
    if path.is_file():
        with path.open() as f:
            texts = [json.loads(line)["question"] for _, line in zip(range(count), f)]
    else:
        texts = [f"Question {i}: what is {i} times {i + 3}? Think step by step." for i in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}])[-96:] for t in texts]


def run_once(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[int, float]:
    done = [False] * len(prompts)
    tokens = [0] * len(prompts)

    def collect(i):
        def on_event(ev):
            tokens[i] = ev.completion_tokens
            if ev.finish_reason is not None:
                done[i] = True

        return on_event

    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(make_sequences(p, params, 1, collect(i)))
    while not all(done):
        engine.step()
    return sum(tokens), time.perf_counter() - t


def make_engine(runner, tokenizer, mode: str, block: int, max_batch: int) -> Engine:
    if mode == "off":
        return Engine(runner, tokenizer, max_batch=max_batch)
    simulate = None
    drafter = mode
    if mode.startswith("simulated"):  # "simulated X" (default drafter) or "simulated X DRAFTER"
        words = mode.split()
        simulate = float(words[1])
        drafter = words[2] if len(words) > 2 else default_drafter(runner)
    decoder = SpeculativeDecoder(runner, build_drafter(drafter, runner), block_size=block, simulate_acc_len=simulate)
    return Engine(runner, tokenizer, max_batch=max_batch, decoder=decoder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir or built-in name (default: evalpipe-skills-dsv4)")
    ap.add_argument("--prompts", choices=("arith", "gsm8k"), default="arith", help="workload (see above)")
    ap.add_argument("--new-tokens", type=int, default=64, help="completion tokens per request")
    ap.add_argument("--block-size", type=int, default=5, help="drafts per verify step (G)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="concurrent requests per row group")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=None,
        help="rows: off, layerskip:N, ngram, self, 'simulated X' (drafts from the default drafter), "
        "'simulated X DRAFTER' (default: off, layerskip:2, layerskip:3, ngram, self, simulated 5.5, "
        "simulated 5.5 ngram)",
    )
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per row (median reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check: tiny model, 4 tokens, concurrency 1, modes off / ngram / simulated, 1 repeat",
    )
    args = ap.parse_args()
    if args.smoke:
        args.model, args.new_tokens, args.concurrency, args.repeats = "evalpipe-tiny-dsv4", 4, [1], 1
        args.modes = ["off", "ngram", "simulated 5.5 ngram"]
    torch.set_num_threads(args.threads)

    runner = ModelRunner(args.model, max_seqs=max(args.concurrency), max_seq_len=1024)
    tokenizer = load_tokenizer(None)
    modes = args.modes or list(
        dict.fromkeys(
            [
                "off",
                "layerskip:2",
                "layerskip:3",
                default_drafter(runner),
                "ngram",
                "self",
                "simulated 5.5",
                "simulated 5.5 ngram",
            ]
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts_all = load_prompts(tokenizer, max(args.concurrency), args.prompts)

    rows, hists = [], {}
    for conc in args.concurrency:
        prompts = prompts_all[:conc]
        base = None
        for mode in modes:
            engine = make_engine(runner, tokenizer, mode, args.block_size, conc)
            run_once(engine, prompts[:1], replace(params, max_tokens=8))  # warm-up
            rates = []
            for _ in range(args.repeats):
                n, secs = run_once(engine, prompts, params)
                rates.append(n / secs)
            rate = statistics.median(rates)
            base = rate if mode == "off" else base
            totals = engine.decoder.describe().get("totals") or {}
            acc = totals.get("avg_accept_length")
            rows.append((conc, mode, rate, acc, rate / base if base else float("nan")))
            if totals and conc == args.concurrency[0]:
                hists[mode] = totals["accept_histogram"]
            print(f"  measured: concurrency {conc:>3}  {mode:<20} {rate:8.1f} tok/s", flush=True)

    print(
        f"\nBlock speculation on CPU ({torch.get_num_threads()} thread(s)), {runner.model_name}, {args.prompts} "
        f"prompts, G={args.block_size}, {args.new_tokens} greedy tokens per request"
    )
    print(f"{'concurrency':>11}  {'mode':<20} {'tok/s':>9} {'accept len':>10} {'speedup':>8}")
    for conc, mode, rate, acc, speed in rows:
        acc_s = f"{acc:.2f}" if acc is not None else "-"
        print(f"{conc:>11}  {mode:<20} {rate:9.1f} {acc_s:>10} {speed:7.2f}x")
    print(f"\nAccepted drafts per verify step (histogram 0..G, concurrency {args.concurrency[0]}, incl. warm-up):")
    for mode, hist in hists.items():
        steps = sum(hist)
        share = " ".join(f"{h / steps:.2f}" for h in hist) if steps else "-"
        print(f"  {mode:<20} {hist}  shares {share}")


if __name__ == "__main__":
    main()
