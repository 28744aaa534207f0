"""Where a checkpoint's `arith` answers go wrong: teacher-forced argmax errors per part of the worked answer.

    python -m benchmarks.model.arith_error_positions [--model DIR] [--n 40] [--n-ops 3]
    python -m benchmarks.model.arith_error_positions --records RUN/responses.jsonl[.gz]

Each held-out problem (the checkout's `evalpipe.skills.arith` format) is run once through transformers'
`DeepseekV4ForCausalLM` with its reference answer, and every answer byte whose argmax differs from the reference is
counted against the part of the line it belongs to: the day, the name, the running value `a` (the story's start on
the first line, the previous result after), the operand `x` (always from the story, beyond the sliding window), the
digit columns (where the format has them), the restated `a op x = <<a op x=`, the result `r` (computed there, or read
off the columns), its copy after `>>`, the item. It separates
arithmetic errors from recall errors, which the lane's exact-answer score cannot.

`--records` reads an `arith` run's records instead (no model): for every `a op x = <<a op x=r>>` a reply wrote, is
`r` right for the `a` and `x` it wrote, by operation and by the digits of the larger operand.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import random
import re
import sys
from pathlib import Path

import torch

from evalpipe.skills import arith, draw
from training.data import encode

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "evalpipe" / "models" / "evalpipe-skills-dsv4"
LINE = re.compile(
    r"( ?On \w+, )(\w+)( has )(\d+)( [-+*/] )(\d+)(: .*?;)?( \d+ [-+*/] \d+)?( = <<\d+[-+*/]\d+=)(\d+)(>>)(\d+)"
    r"( \w+\.)"
)
PARTS = [
    "day",
    "name",
    "text",
    "a",
    "op",
    "x",
    "columns",
    "restatement",
    "restatement",
    "result",
    "restatement",
    "result copy",
    "item",
]


def labels_of(completion: str) -> list[str]:
    """One part name per byte of the completion, then one for the closing end-of-sequence token."""
    labels: list[str] = []
    for line in completion.split("\n"):
        m = LINE.fullmatch(line)
        if m:
            for group, part in zip(m.groups(), PARTS):
                labels += [part] * len(group or "")
        else:
            labels += ["final line"] * len(line)
        labels.append("newline")
    return labels[: len(completion)] + ["eos"]


def record_arithmetic(path: Path) -> None:
    """Per-operation accuracy of the results the replies in `path` wrote, given the operands they wrote."""
    opener = gzip.open if path.suffix == ".gz" else open
    seen, right = collections.Counter(), collections.Counter()
    with opener(path, "rt") as f:
        for line in f:
            reply = json.loads(line).get("response_text") or ""
            for a, op, x, r in re.findall(r"(\d+) ([-+*/]) (\d+) = <<\d+[-+*/]\d+=(\d+)>>", reply):
                a, x, r = int(a), int(x), int(r)
                truth = {"+": a + x, "-": a - x, "*": a * x, "/": a // x if x else None}[op]
                for key in (op, f"{op} ({len(str(max(a, x)))} digits)"):
                    seen[key] += 1
                    right[key] += truth == r
    print(f"{path}: results right given the operands the reply wrote")
    print("| operation | right | written | share right |\n|---|---:|---:|---:|")
    for key in sorted(seen, key=lambda k: (k[0], len(k), k)):
        print(f"| `{key}` | {right[key]} | {seen[key]} | {right[key] / seen[key]:.3f} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint folder (default: the shipped model)")
    ap.add_argument("--n", type=int, default=40, help="held-out problems")
    ap.add_argument("--n-ops", type=int, default=3, choices=[2, 3, 4], help="operations per problem")
    ap.add_argument("--seed", type=int, default=99, help="seed of the held-out draw")
    ap.add_argument(
        "--records",
        type=Path,
        default=None,
        help="an arith run's responses.jsonl(.gz): score the replies' own arithmetic instead",
    )
    ap.add_argument("--smoke", action="store_true", help="CI check: 1 problem of 2 operations")
    args = ap.parse_args(argv)
    if args.smoke:
        args.n, args.n_ops = 1, 2
    if args.records:
        record_arithmetic(args.records)
        return 0

    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rng = random.Random(args.seed)
    seen, wrong, exact = collections.Counter(), collections.Counter(), 0
    for _ in range(args.n):
        ex = draw(lambda r: arith.generate(r, n_ops=args.n_ops), rng, "heldout")
        enc = encode(ex)
        ids = torch.tensor([enc.ids])
        with torch.no_grad():
            pred = model(ids).logits[0, :-1].argmax(-1)
        target = ids[0, 1:]
        all_right = True
        for j, part in enumerate(labels_of(ex.completion)):
            seen[part] += 1
            if pred[enc.n_prompt - 1 + j] != target[enc.n_prompt - 1 + j]:
                wrong[part] += 1
                all_right = False
        exact += all_right
    print(f"{args.model}: {exact}/{args.n} answers exact (teacher-forced), {args.n_ops} operations")
    print("| part | wrong bytes | bytes | error rate |\n|---|---:|---:|---:|")
    for part in seen:
        print(f"| {part} | {wrong[part]} | {seen[part]} | {wrong[part] / seen[part]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
