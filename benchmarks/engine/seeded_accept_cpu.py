"""Accept length of sampled block speculation on the CPU, keyed sample-verify (`--deterministic`) vs rejection
sampling (the stream sampler), per drafter, side by side in one run; and whether the keyed rows replay spec off.

Each row drives the real engine loop in process over the same prompts at temperature T with one seed per request,
`ignore_eos`, every request generating --new-tokens tokens, all requests in one batch. Accept length is the
server-wide completion tokens / verify steps (bonus included); accepted is accepted drafts / verify step. A keyed
row also counts the requests whose tokens equal keyed spec-off decoding of the same seeds ("replays"). Rejection
sampling accepts d with min(1, p(d) / q(d)); sample-verify accepts d iff d is the target's keyed sample: for the
n-gram drafter (one-hot q) both accept with probability p(d); a model drafter samples with the request's key, and
its acceptance is at most rejection sampling's 1 - TV(p, q) in expectation. One run of 8 requests: the two modes
follow different paths, so their accept lengths also differ by chance.

    python -m benchmarks.engine.seeded_accept_cpu [--model evalpipe-skills-dsv4] [--prompts arith|random]
        [--requests 8] [--new-tokens 48] [--temperature 1.0] [--drafters layerskip:4 layerskip:2 ngram self]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.engine.spec_cpu import load_prompts
from evalpipe.engine.engine import Engine
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.tokenizer import load_tokenizer

SEED0 = 4600


def random_prompts(count: int, vocab: int) -> list[list[int]]:
    """Uniform random token prompts of 16..63 tokens (seeded): uncertain continuations, many rejections."""
    gen = torch.Generator().manual_seed(46)
    lengths = torch.randint(16, 64, (count,), generator=gen).tolist()
    return [[1] + torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    seqs = [
        Sequence(prompt=list(p), params=SamplingParams(**{**params.__dict__, "seed": SEED0 + i}))
        for i, p in enumerate(prompts)
    ]
    engine.submit(seqs)
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
    return [s.output for s in seqs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir or built-in name (default: evalpipe-skills-dsv4)")
    ap.add_argument("--prompts", choices=("arith", "random"), default="arith", help="arith lane items or random ids")
    ap.add_argument("--requests", type=int, default=8, help="requests (one batch)")
    ap.add_argument("--new-tokens", type=int, default=48, help="completion tokens per request")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    ap.add_argument("--block-size", type=int, default=5, help="drafts per verify step (G)")
    ap.add_argument("--drafters", nargs="+", default=None, help="default: layerskip:4 layerskip:2 ngram self")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--smoke", action="store_true", help="CI check: tiny model, 2 requests, 6 tokens, ngram only")
    args = ap.parse_args()
    if args.smoke:
        args.model, args.requests, args.new_tokens, args.drafters = "evalpipe-tiny-dsv4", 2, 6, ["ngram"]
    torch.set_num_threads(args.threads)

    runner = ModelRunner(args.model, max_seqs=args.requests, max_seq_len=1024)
    tokenizer = load_tokenizer(None)
    drafters = args.drafters or ["layerskip:4", "layerskip:2", "ngram", "self"]
    vocab = int(runner.config.vocab_size)
    prompts = (
        load_prompts(tokenizer, args.requests, "arith")
        if args.prompts == "arith"
        else random_prompts(args.requests, vocab)
    )
    params = SamplingParams(temperature=args.temperature, max_tokens=args.new_tokens, ignore_eos=True)
    plain = generate(Engine(runner, tokenizer, max_batch=args.requests, keyed_sampling=True), prompts, params)

    rows = []
    for name in drafters:
        drafter = build_drafter(name, runner)
        for keyed in (True, False):
            decoder = SpeculativeDecoder(runner, drafter, block_size=args.block_size)
            engine = Engine(runner, tokenizer, max_batch=args.requests, decoder=decoder, keyed_sampling=keyed)
            out = generate(engine, prompts, params)
            totals = decoder.describe()["totals"]
            replays = f"{sum(a == b for a, b in zip(out, plain))}/{len(out)}" if keyed else "-"
            rows.append(
                (
                    name,
                    "keyed sample-verify" if keyed else "rejection sampling",
                    totals["avg_accept_length"],
                    totals["avg_accepted_drafts_per_step"],
                    totals["verify_steps"],
                    replays,
                )
            )
            print(f"  measured: {name:<12} {rows[-1][1]}", flush=True)

    print(
        f"\nSampled block speculation on CPU, {runner.model_name}, {args.prompts} prompts, {args.requests} requests x "
        f"{args.new_tokens} tokens, T={args.temperature}, G={args.block_size}"
    )
    print(f"{'drafter':<12}  {'verify':<20}  {'accept len':>10}  {'accepted':>8}  {'steps':>6}  {'replays':>7}")
    for name, mode, acc, drafts, steps, replays in rows:
        print(f"{name:<12}  {mode:<20}  {acc:>10.2f}  {drafts:>8.2f}  {steps:>6}  {replays:>7}")


if __name__ == "__main__":
    main()
