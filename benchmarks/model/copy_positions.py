"""Where a checkpoint's `retrieval` and `copy` answers go wrong: teacher-forced argmax accuracy per answer position.

    python -m benchmarks.model.copy_positions [--model DIR] [--n 12]

Held-out items of the checkout's `evalpipe.skills` are run once through transformers' `DeepseekV4ForCausalLM` with
their reference answer; each answer position counts as right when its argmax is the reference token, given the
reference before it. Retrieval is reported per answer position (the leading space, then the five digits of the
code) at three depths, one of them inside the sliding window; copy per block of 10 characters. A model that finds
the needle but cannot copy shows right leading digits and wrong trailing ones even inside the window, where every
digit of the code is in plain view of the sliding attention.
"""

from __future__ import annotations

import argparse
import collections
import random
from pathlib import Path

import torch

from evalpipe.skills import copy_text, draw, retrieval
from training.data import encode

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "evalpipe" / "models" / "evalpipe-skills-dsv4"


def position_hits(model, example) -> list[int]:
    """1/0 per answer token (the end-of-sequence token left out): argmax == reference under teacher forcing."""
    enc = encode(example)
    ids = enc.ids[:-1]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    pred = logits[enc.n_prompt - 1 : len(ids) - 1].argmax(-1).tolist()
    return [int(p == t) for p, t in zip(pred, ids[enc.n_prompt :])]


def table(name: str, hits: dict[int, list[int]], label) -> str:
    return f"{name:<28}" + "  ".join(f"{label(k)}: {sum(v) / len(v):.2f}" for k, v in sorted(hits.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint folder (default: the shipped model)")
    ap.add_argument("--n", type=int, default=12, help="held-out items per row")
    ap.add_argument("--seed", type=int, default=5, help="seed of the held-out draw")
    ap.add_argument("--smoke", action="store_true", help="CI check: 1 item per row")
    args = ap.parse_args()
    if args.smoke:
        args.n = 1
    torch.set_num_threads(1)
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = random.Random(args.seed)
    print(f"teacher-forced argmax accuracy per answer position, {args.n} held-out items per row, {args.model.name}")
    for depth, after in (("in the window", 0), ("~256 bytes deep", 200), ("~2048 bytes deep", 2000)):
        hits = collections.defaultdict(list)
        for _ in range(args.n):
            for i, h in enumerate(
                position_hits(model, draw(lambda r: retrieval.generate(r, after=after), rng, "heldout"))
            ):
                hits[i].append(h)
        print(table(f"retrieval, {depth}", hits, lambda k: "space" if k == 0 else f"digit {k}"))
    hits = collections.defaultdict(list)
    for _ in range(args.n):
        for i, h in enumerate(position_hits(model, draw(copy_text.generate, rng, "heldout"))):
            hits[i // 10].append(h)
    print(table("copy, per 10 characters", hits, lambda k: f"{10 * k}-"))


if __name__ == "__main__":
    main()
