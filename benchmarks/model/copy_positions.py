"""Where a checkpoint's copies and retrievals go wrong: teacher-forced argmax accuracy per answer position.

    python -m benchmarks.model.copy_positions [--model DIR] [--n 12] [--json OUT]   # the "before/after" table
    python -m benchmarks.model.copy_positions --smoke                                # 1 item per row, seconds

Held-out items of the checkout's `evalpipe.skills` are run once through transformers' `DeepseekV4ForCausalLM` with
their reference answer; an answer position counts as right when its argmax is the reference token, given the
reference before it (so the greedy reply is exact when every position is right: the `exact` column).

- copy: random strings shorter than the sliding window (4-60 characters), of the copy lane's lengths (72-160) and longer
  (161-256), accuracy per block of 16 answer tokens (the HCA block; the leading space, then the characters; a
  block past the string's end is blank);
- retrieval: a five-digit code at each depth (bytes from the code to the end of the prompt, up to the full
  context), accuracy per answer position (the leading space, then each digit).

A model that finds the needle but cannot copy shows right leading digits and wrong trailing ones even inside the
window; one that copies only inside the window shows right first blocks and wrong later ones.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from evalpipe.skills import copy_text, draw, retrieval
from training.data import encode

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "evalpipe" / "models" / "evalpipe-skills-dsv4"
BLOCK = 16  # copy positions are reported per block of this many characters
COPY_ROWS = [("copy 4-60 (< window)", 4, 60), ("copy 72-160 (lane)", 72, 160), ("copy 161-256", 161, 256)]
DEPTHS = [("in-window", 0), ("~256", 200), ("~1024", 950), ("~2048", 1950), ("~3000", 2900), ("~3800", 3750)]


def position_hits(model, example) -> list[int]:
    """1/0 per answer token (the end-of-sequence token left out): argmax == reference under teacher forcing."""
    enc = encode(example)
    ids = enc.ids[:-1]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    pred = logits[enc.n_prompt - 1 : len(ids) - 1].argmax(-1).tolist()
    return [int(p == t) for p, t in zip(pred, ids[enc.n_prompt :])]


def measure(model, n: int, seed: int, depths: list) -> dict:
    """{"copy": {row: {"exact", "n", "positions": [share right per block]}}, "retrieval": {depth: {...}}}."""
    rng = random.Random(seed)
    out: dict = {"copy": {}, "retrieval": {}}
    for label, lo, hi in COPY_ROWS:
        rows = [
            position_hits(model, draw(lambda r: copy_text.generate(r, length=r.randint(lo, hi)), rng, "heldout"))
            for _ in range(n)
        ]
        out["copy"][label] = summarize(rows, BLOCK)
    for label, after in depths:
        rows = []
        for _ in range(n):
            ex = draw(lambda r: retrieval.generate(r, after=after, before=0 if after > 3000 else None), rng, "heldout")
            rows.append(position_hits(model, ex))
        out["retrieval"][label] = summarize(rows, 1)
    return out


def summarize(rows: list[list[int]], block: int) -> dict:
    """Exact share, and per position block the share of right positions among the rows that reach it."""
    width = max(len(r) for r in rows)
    blocks = []
    for start in range(0, width, block):
        cells = [h for r in rows for h in r[start : start + block]]
        blocks.append(round(sum(cells) / len(cells), 3) if cells else None)
    return {"n": len(rows), "exact": round(sum(all(r) for r in rows) / len(rows), 3), "positions": blocks}


def table(title: str, rows: dict, header: list[str]) -> str:
    width = max(len(h) for h in header)
    lines = [title, f"{'':<24}{'exact':>7} " + " ".join(f"{h:>{width}}" for h in header)]
    for label, row in rows.items():
        cells = [f"{v:>{width}.2f}" if v is not None else " " * width for v in row["positions"]]
        cells += [" " * width] * (len(header) - len(cells))
        lines.append(f"{label:<24}{row['exact']:>7.2f} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint folder (default: the shipped model)")
    ap.add_argument("--n", type=int, default=12, help="held-out items per row")
    ap.add_argument("--seed", type=int, default=5, help="seed of the held-out draw")
    ap.add_argument("--json", type=Path, default=None, help="also write the table's numbers to this JSON file")
    ap.add_argument(
        "--smoke", action="store_true", help="1 item per row, the two shallowest depths (seconds, for tests)"
    )
    args = ap.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise SystemExit(f"--model {args.model}: no config.json there (not a checkpoint folder)")
    if args.n < 1:
        raise SystemExit("--n must be at least 1")
    # --smoke: a ~3800-token forward through transformers would be most of the run on one CPU thread
    n, depths = (1, DEPTHS[:2]) if args.smoke else (args.n, DEPTHS)
    torch.set_num_threads(1)
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    result = measure(model, n, args.seed, depths)
    print(f"teacher-forced argmax accuracy per answer position, {n} held-out items per row, {args.model.name}")
    blocks = max(len(row["positions"]) for row in result["copy"].values())
    print(
        table(
            f"copy: share right per block of {BLOCK} answer tokens (the leading space, then the characters)",
            result["copy"],
            [f"{BLOCK * k}-" for k in range(blocks)],
        )
    )
    print(
        table(
            "retrieval (five-digit code): share right per answer position, by depth",
            result["retrieval"],
            ["space"] + [f"digit{k}" for k in range(1, 6)],
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "n": n, "seed": args.seed, **result}, indent=1))


if __name__ == "__main__":
    main()
