"""Constrained decoding under block speculation on the CPU: the trained default model on its own tool-call and JSON
questions, free vs grammar-masked, speculation off vs the default layerskip drafter vs ngram, greedy.

Per row: tok/s (completion tokens over wall time, submit to last finish, N requests at once), accept length
(completion tokens / verify steps), and how many outputs equal plain greedy decoding with the same grammar token for
token (the lossless property tests/engine/test_grammar_lossless.py checks; here over more prompts), and how many are
valid (a call of a listed tool with its required arguments, or JSON matching the skill's schema).

    python -m benchmarks.engine.structured_spec_cpu [--requests 16] [--block-size 5]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from evalpipe.engine.engine import Engine
from evalpipe.engine.grammar_constraint import GrammarConstraint
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import make_sequences
from evalpipe.engine.spec.decoder import SpeculativeDecoder, default_drafter
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.skills import chat


def run(engine, prompts, params):
    out = [{"ids": [], "done": False} for _ in prompts]
    for i, p in enumerate(prompts):

        def on_event(ev, r=out[i]):
            r["ids"] += ev.token_ids
            r["done"] = r["done"] or ev.finish_reason is not None

        engine.submit(make_sequences(p, params, 1, on_event))
    t0 = time.perf_counter()
    while not all(r["done"] for r in out):
        engine.step()
    return [r["ids"] for r in out], time.perf_counter() - t0


def valid(tok, kind, ids) -> bool:
    text = tok.decode(ids)
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if kind == "json":
        return set(obj) == {"name", "count"} and isinstance(obj["count"], int)
    tools = {t["function"]["name"]: t["function"]["parameters"]["required"] for t in chat.TOOLS}
    return (
        ids[:1] == [tok.tool_call_token_id]
        and obj.get("name") in tools
        and set(obj.get("arguments", {})) == set(tools[obj["name"]])
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16, help="prompts per workload, all in flight together")
    ap.add_argument("--block-size", type=int, default=5, help="drafts per verify (G)")
    ap.add_argument("--max-tokens", type=int, default=96, help="completion limit (a call takes about 70)")
    ap.add_argument("--smoke", action="store_true", help="CI check: 1 request per workload, 8 tokens")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.max_tokens = 1, 8
    torch.set_num_threads(1)
    tok = load_tokenizer(None)
    runner = ModelRunner("evalpipe-skills-dsv4", max_seqs=args.requests, max_seq_len=1024)
    rng = random.Random(0)
    workloads = {
        "tool_call": [
            tok.apply_chat_template(e.messages, tools=e.tools)
            for e in (chat.tool_call(rng) for _ in range(args.requests))
        ],
        "json": [tok.apply_chat_template(e.messages) for e in (chat.json_reply(rng) for _ in range(args.requests))],
    }
    calls = [(t["function"]["name"], t["function"]["parameters"]) for t in chat.TOOLS]
    grammars = {
        "tool_call": GrammarConstraint.tool_calls(tok.tool_call_token_id, calls, parallel=False),
        "json": GrammarConstraint.json(chat.JSON_SCHEMA),
    }
    decoders = {
        "off": lambda: None,
        default_drafter(runner): lambda: SpeculativeDecoder(
            runner, build_drafter(default_drafter(runner), runner), block_size=args.block_size
        ),
        "ngram": lambda: SpeculativeDecoder(runner, build_drafter("ngram", runner), block_size=args.block_size),
    }
    print("| workload | grammar | speculation | tok/s | accept len | equal to plain | valid |")
    print("|---|---|---|---|---|---|---|")
    for kind, prompts in workloads.items():
        for constrained in (False, True):
            params = SamplingParams(
                temperature=0.0, max_tokens=args.max_tokens, grammar=grammars[kind] if constrained else None
            )
            reference = None
            for name, make in decoders.items():
                decoder = make()
                engine = Engine(runner, tok, max_batch=args.requests, decoder=decoder)
                outs, wall = run(engine, prompts, params)
                reference = outs if reference is None else reference
                same = sum(a == b for a, b in zip(outs, reference))
                tokens = sum(len(o) for o in outs)
                acc = decoder.totals.to_dict()["avg_accept_length"] if decoder is not None else None
                print(
                    f"| {kind} | {'on' if constrained else 'off'} | {name} | {tokens / wall:.1f} | "
                    f"{'–' if acc is None else f'{acc:.2f}'} | {same}/{len(outs)} | "
                    f"{sum(valid(tok, kind, o) for o in outs)}/{len(outs)} |"
                )


if __name__ == "__main__":
    main()
