"""min_tokens, include_stop_str_in_output and prompt logprobs inside the engine loop (in process, real runner, real
tokenizer), with plain decoding and block speculation: the same tokens, text and finish either way, stops held back
until min_tokens even when they would land inside an accepted block, and prompt logprobs that do not depend on how
the prompt was chunked or decoded."""

from __future__ import annotations

from dataclasses import replace

import test_spec_engine
import torch
from test_spec_engine import run

from evalpipe.engine.engine import Engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter

# test_spec_engine's module-scoped runner and tokenizer fixtures, shared rather than built twice
runner, tokenizer = test_spec_engine.runner, test_spec_engine.tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def engines(runner, tokenizer, max_tokens_per_step=512):
    plain = Engine(runner, tokenizer, max_batch=8, max_tokens_per_step=max_tokens_per_step)
    specs = [
        Engine(
            runner,
            tokenizer,
            max_batch=8,
            max_tokens_per_step=max_tokens_per_step,
            decoder=SpeculativeDecoder(runner, build_drafter(d, runner), block_size=b),
        )
        for d, b in (("self", 6), ("layerskip:2", 4))
    ]
    return [plain, *specs]


def test_min_tokens_holds_stop_tokens_back_in_plain_and_speculative_decoding(runner, tokenizer):
    prompt = tokenizer.encode_prompt("Once upon a time")
    base = run(Engine(runner, tokenizer), [(prompt, GREEDY)])[0]["token_ids"]
    stop_ids = (base[0], base[3])  # stops the model produces at once and inside the first block
    requests = [
        (prompt, replace(GREEDY, stop_token_ids=stop_ids)),
        (prompt, replace(GREEDY, stop_token_ids=stop_ids, min_tokens=7)),
        (prompt, replace(GREEDY, stop_token_ids=stop_ids, min_tokens=7, include_stop_str_in_output=True)),
        (prompt, replace(GREEDY, stop_token_ids=stop_ids, min_tokens=20)),
    ]
    results = [run(engine, requests) for engine in engines(runner, tokenizer)]
    for other in results[1:]:
        assert [(r["token_ids"], r["text"], r["finish_reason"]) for r in other] == [
            (r["token_ids"], r["text"], r["finish_reason"]) for r in results[0]
        ]
    unheld, held, kept, full = results[0]
    stops = {*stop_ids, tokenizer.eos_token_id}
    assert unheld["token_ids"] == [base[0]] and unheld["finish_reason"] == "stop"
    assert not set(held["token_ids"][:7]) & stops and len(held["token_ids"]) >= 7
    assert held["finish_reason"] == "stop"  # a stop after min_tokens ends it; its text only with include_stop_str
    stop = held["token_ids"][-1]
    assert stop in stops and kept["text"] == held["text"] + tokenizer.decode([stop])
    assert len(full["token_ids"]) == 20 and not set(full["token_ids"]) & stops


def test_prompt_logprobs_do_not_depend_on_chunks_or_the_decoder(runner, tokenizer):
    prompt = tokenizer.encode_prompt("The quick brown fox jumps over the lazy dog, again and again and again.")
    params = replace(GREEDY, max_tokens=3, prompt_logprobs=2)
    seen = []
    for chunk in (512, 7):
        for engine in engines(runner, tokenizer, max_tokens_per_step=chunk):
            events = []
            seqs_done = run_with_events(engine, prompt, params, events)
            scored = [ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None]
            assert len(scored) == 1 and seqs_done  # on the first event only
            seen.append(scored[0])
    first = seen[0]
    assert len(first) == len(prompt) and first[0] is None
    assert [e["id"] for e in first[1:]] == prompt[1:]
    for other in seen[1:]:
        assert [e is None for e in other] == [e is None for e in first]
        got = torch.tensor([e["logprob"] for e in other[1:]])
        want = torch.tensor([e["logprob"] for e in first[1:]])
        assert torch.allclose(got, want, atol=1e-4)
        assert [e["rank"] for e in other[1:]] == [e["rank"] for e in first[1:]]


def run_with_events(engine: Engine, prompt: list[int], params: SamplingParams, events: list) -> bool:
    from evalpipe.engine.scheduler import make_sequences

    engine.submit(make_sequences(prompt, params, 1, events.append))
    for _ in range(1000):
        if any(ev.finish_reason for ev in events):
            return True
        engine.step()
    return False
