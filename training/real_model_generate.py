"""Greedy generation with transformers on the real model's own weights, for the chat requests a server was sent: does
the model itself give the answer, where the served one did not?

It reads an `evalpipe run` folder (responses.jsonl: each record's request messages, group, expected answer and
reply) or an `evalpipe qualify` folder (qualify.json: the retrieval gate's records), renders each chat with the
model's chat template and the generation prompt (as vLLM does: the template's text, tokenized without added special
tokens), generates greedily up to the request's max_tokens, stops at the end-of-turn token, and prints per group:
items, exact answers from transformers, exact answers served, and replies that agree. Run it with the vLLM
environment's python (torch and transformers):

    .venv-vllm/bin/python training/real_model_generate.py RUN_OR_QUALIFY_DIR [--model DIR] [--dtype float32]
        [--per-group N] [--out FILE.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / ".evalpipe-cache" / "models" / "SmolLM2-135M-Instruct"


def requests_of(folder: Path) -> list[dict]:
    """[{id, group, messages, max_tokens, expected, served}] from a run or a qualify folder, in file order."""
    if (folder / "responses.jsonl").exists():
        out = []
        for line in (folder / "responses.jsonl").read_text().splitlines():
            r = json.loads(line)
            out.append(
                {
                    "id": r["question_id"],
                    "group": r["group"],
                    "messages": r["request"]["messages"],
                    "max_tokens": r["request"]["max_tokens"],
                    "expected": r["expected_answer"],
                    "served": r["response_text"] or "",
                }
            )
        return out
    gates = json.loads((folder / "qualify.json").read_text())["gates"]
    records = next(g["records"] for g in gates if g["gate"] == "retrieval")
    return [
        {
            "id": r["id"],
            "group": f"depth {r['depth']}",
            "messages": r["body"]["messages"],
            "max_tokens": r["body"]["max_tokens"],
            "expected": r["expected"],
            "served": (r.get("output") or {}).get("text") or "",
        }
        for r in records
        if "messages" in r["body"]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="an `evalpipe run` folder or an `evalpipe qualify` folder")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the HF folder (default: make real-model's)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    ap.add_argument("--per-group", type=int, default=0, help="only the first N requests of each group (0: all)")
    ap.add_argument("--out", type=Path, help="write one JSON line per request here")
    args = ap.parse_args(argv)
    try:
        requests = requests_of(args.folder)
    except (OSError, ValueError, KeyError, StopIteration) as e:
        print(
            f"{args.folder}: not a run or qualify folder with chat requests ({type(e).__name__}: {e})", file=sys.stderr
        )
        return 2
    if args.per_group:
        kept, seen = [], defaultdict(int)
        for r in requests:
            seen[r["group"]] += 1
            if seen[r["group"]] <= args.per_group:
                kept.append(r)
        requests = kept

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    end_ids = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
    rows = []
    for r in requests:
        text = tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=r["max_tokens"],
                do_sample=False,
                eos_token_id=end_ids,
                pad_token_id=tok.eos_token_id,
            )
        reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        row = {
            **{k: r[k] for k in ("id", "group", "expected", "served")},
            "prompt_tokens": ids.shape[1],
            "transformers": reply,
            "transformers_exact": reply.strip() == r["expected"],
            "served_exact": r["served"].strip() == r["expected"],
            "agree": reply.strip() == r["served"].strip(),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"{'group':<12} {'items':>5} {'transformers exact':>18} {'served exact':>12} {'agree':>5}")
    for group in dict.fromkeys(r["group"] for r in rows):
        g = [r for r in rows if r["group"] == group]
        counts = [sum(r[k] for r in g) for k in ("transformers_exact", "served_exact", "agree")]
        print(f"{group:<12} {len(g):>5} {counts[0]:>18} {counts[1]:>12} {counts[2]:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
