"""Constrained decoding under block speculation, in process with the trained default model: greedy with the grammar
mask on every verify row (drafts accepted tentatively, the matcher rolled back to what the target accepted) gives the
same tokens as plain greedy decoding with the same grammar, token for token, for tool calls (required and named) and a
JSON schema, several prompts batched together. Every output replays through a fresh matcher and ends at the stop
token, and seeded sampling under speculation still produces only grammar-valid output."""

from __future__ import annotations

import json
import random

import pytest

from evalpipe.engine.engine import Engine
from evalpipe.engine.grammar import Grammars
from evalpipe.engine.grammar_constraint import GrammarConstraint
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import make_sequences
from evalpipe.engine.spec.decoder import SpeculativeDecoder, default_drafter
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.skills import chat

MAX_TOKENS = 96
CALLS = [(t["function"]["name"], t["function"]["parameters"]) for t in chat.TOOLS]


@pytest.fixture(scope="module")
def runner():
    return ModelRunner("evalpipe-skills-dsv4", max_seqs=8, max_seq_len=1024)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Tool questions (answered by a call), a JSON question, and an arithmetic one that the grammar must bend."""
    rng = random.Random(16)
    examples = [chat.tool_call(rng) for _ in range(2)] + [
        chat.json_reply(rng),
        chat.from_example(chat.arith.generate(rng)),
    ]
    return [tokenizer.apply_chat_template(ex.messages, tools=chat.TOOLS) for ex in examples]


GRAMMARS = {
    "required": GrammarConstraint.tool_calls(10, CALLS, parallel=False),
    "named": GrammarConstraint.tool_calls(10, CALLS[1:], parallel=False),
    "json_schema": GrammarConstraint.json(chat.JSON_SCHEMA),
}


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    results = [{"ids": [], "finish": None} for _ in prompts]
    for i, prompt in enumerate(prompts):

        def on_event(ev, r=results[i]):
            r["ids"] += ev.token_ids
            if ev.finish_reason is not None:
                r["finish"] = ev.finish_reason

        engine.submit(make_sequences(prompt, params, 1, on_event))
    for _ in range(5000):
        if all(r["finish"] for r in results):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.fixture(scope="module")
def engines(runner, tokenizer):
    drafter = build_drafter(default_drafter(runner), runner)
    return (
        Engine(runner, tokenizer, max_batch=8),
        Engine(runner, tokenizer, max_batch=8, decoder=SpeculativeDecoder(runner, drafter, block_size=5)),
    )


def replays(grammars: Grammars, spec: GrammarConstraint, ids: list[int]) -> bool:
    """A fresh matcher accepts the whole output and is terminated by its last token (the stop token)."""
    c = grammars.matcher(spec, 1)
    return all(c.matcher.accept_token(t) for t in ids) and c.terminated


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_speculation_equals_plain_decoding_under_a_grammar(engines, prompts, tokenizer, kind):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, grammar=GRAMMARS[kind])
    expected = run(plain, prompts, params)
    got = run(spec, prompts, params)
    for e, g in zip(expected, got):
        assert g["ids"] == e["ids"], (tokenizer.decode(e["ids"]), tokenizer.decode(g["ids"]))
        assert g["finish"] == e["finish"] == "stop"
        assert replays(plain.grammars, GRAMMARS[kind], e["ids"])
    if kind != "json_schema":
        for e in expected:  # the marker, then the call JSON with the fixed name
            assert e["ids"][0] == tokenizer.tool_call_token_id
            call = json.loads(tokenizer.decode(e["ids"][1:]))
            assert call["name"] in ([n for n, _ in CALLS] if kind == "required" else [CALLS[1][0]])
            assert set(call["arguments"]) <= set(dict(CALLS)[call["name"]]["properties"])
    hist = spec.decoder.totals.to_dict()["accept_histogram"]
    # drafts were accepted under the mask, and rejected ones rolled the matcher back (partial blocks)
    assert sum(i * h for i, h in enumerate(hist)) > 0 and sum(hist[:-1]) > 0


def test_sampled_speculation_stays_inside_the_grammar(engines, prompts, tokenizer):
    _, spec = engines
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, grammar=GRAMMARS["json_schema"])
    for r in run(spec, prompts, params):
        if r["finish"] == "stop":
            obj = json.loads(tokenizer.decode(r["ids"]))
            assert set(obj) <= {"name", "count"} and isinstance(obj["name"], str) and isinstance(obj["count"], int)
            assert replays(spec.grammars, GRAMMARS["json_schema"], r["ids"])
        else:
            assert r["finish"] == "length"


def test_lossy_or_simulated_acceptance_refuses_grammars(runner, tokenizer):
    """A rule that can commit a draft without the exact test could commit a token the grammar forbids."""
    from evalpipe.engine.spec.settings import AcceptRule

    drafter = build_drafter("ngram", runner)
    exact = Engine(runner, tokenizer, decoder=SpeculativeDecoder(runner, drafter, block_size=3))
    lossy = Engine(
        runner, tokenizer, decoder=SpeculativeDecoder(runner, drafter, block_size=3, accept_rule=AcceptRule(topk=2))
    )
    simulated = Engine(
        runner, tokenizer, decoder=SpeculativeDecoder(runner, drafter, block_size=3, simulate_acc_len=2.0)
    )
    assert exact.grammar_blocker() is None
    assert "lossy" in lossy.grammar_blocker() and "simulate" in simulated.grammar_blocker()
