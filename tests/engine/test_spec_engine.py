"""Block speculation inside the engine loop (in process, real runner, real tokenizer): same tokens, text, finish
reasons and matched stops as plain decoding, with stops, stop ids and max_tokens landing inside an accepted block;
seeded sampling repeats; spec statistics are consistent; simulated acceptance only takes floor/ceil lengths."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evalpipe.engine.engine import Engine
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import make_sequences
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.tokenizer import load_tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def runner():
    return ModelRunner("evalpipe-tiny-dsv4", max_seqs=16, max_seq_len=256)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = [
        "The capital of France is",
        "1 + 1 = ",
        "Once upon a time, in a land far away, there lived",
        "def fib(n):\n    return",
    ]
    return [tokenizer.encode(t) for t in texts]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[dict]:
    """Submit every request, step the engine until all finish, return per-request results."""
    results = [
        {"token_ids": [], "text": "", "finish_reason": None, "matched_stop": None, "spec": None, "logprobs": []}
        for _ in requests
    ]

    def collect(i):
        def on_event(ev):
            r = results[i]
            r["token_ids"] += ev.token_ids
            r["text"] += ev.text
            r["logprobs"] += ev.logprobs or []
            if ev.finish_reason is not None:
                r.update(finish_reason=ev.finish_reason, matched_stop=ev.matched_stop, spec=ev.spec)

        return on_event

    for i, (prompt, params) in enumerate(requests):
        engine.submit(make_sequences(prompt, params, 1, collect(i)))
    for _ in range(10_000):
        if all(r["finish_reason"] for r in results):
            return results
        engine.step()
    raise AssertionError("engine did not finish")


def spec_engine(runner, tokenizer, drafter="layerskip:2", block=5, simulate=None) -> Engine:
    decoder = SpeculativeDecoder(runner, build_drafter(drafter, runner), block_size=block, simulate_acc_len=simulate)
    return Engine(runner, tokenizer, max_batch=8, decoder=decoder)


def check_stats(spec: dict, n_tokens: int, block: int) -> None:
    hist = spec["accept_histogram"]
    assert len(hist) == block + 1
    assert sum(hist) == spec["verify_steps"]
    assert sum(i * h for i, h in enumerate(hist)) == spec["accepted_drafts"]
    assert spec["draft_tokens"] == block * spec["verify_steps"]
    if spec["verify_steps"]:
        assert spec["accept_length"] == pytest.approx(n_tokens / spec["verify_steps"])


@pytest.mark.parametrize("drafter,block", [("layerskip:2", 5), ("ngram", 2), ("self", 6)])
def test_engine_speculation_equals_plain_decoding(runner, tokenizer, prompts, drafter, block):
    requests = [
        (p, replace(GREEDY, max_tokens=m, logprobs=lp)) for p, m, lp in zip(prompts, (24, 7, 19, 1), (None, 2, None, 0))
    ]
    plain = run(Engine(runner, tokenizer, max_batch=8), requests)
    engine = spec_engine(runner, tokenizer, drafter, block)
    spec = run(engine, requests)
    for a, b in zip(plain, spec):
        assert {k: v for k, v in a.items() if k not in ("spec", "logprobs")} == {
            k: v for k, v in b.items() if k not in ("spec", "logprobs")
        }
        check_stats(b["spec"], len(b["token_ids"]), block)
        # logprobs of committed tokens come from the verify rows: same ids, same values up to float32 rounding
        assert [(x["id"], [t for t, _ in x["top"]]) for x in a["logprobs"]] == [
            (x["id"], [t for t, _ in x["top"]]) for x in b["logprobs"]
        ]
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert y["logprob"] == pytest.approx(x["logprob"], abs=1e-4)
    assert len(spec[1]["logprobs"]) == 7
    if drafter == "self":  # every draft accepted
        for b in spec:
            assert b["spec"]["accepted_drafts"] == block * b["spec"]["verify_steps"]
    totals = engine.decoder.describe()["totals"]
    assert totals["requests"] == sum(1 for b in spec if b["spec"]["verify_steps"])  # max_tokens=1 never verifies
    assert engine.allocated_slots == 0
    assert totals["verify_steps"] == sum(b["spec"]["verify_steps"] for b in spec)
    assert not engine.decoder.drafter.__dict__.get("_handles"), "draft state must be freed with the request"


def test_stops_inside_an_accepted_block_cut_at_the_right_token(runner, tokenizer, prompts):
    """With the self drafter every step commits G+1 = 6 tokens, so each stop below falls inside a block."""
    prompt = prompts[2]
    ref = run(Engine(runner, tokenizer), [(prompt, replace(GREEDY, max_tokens=30))])[0]
    tokens, text = ref["token_ids"], ref["text"]
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] >= 16 + 33)
    stop_text = next(
        text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].strip() and text.find(text[i : i + 2]) == i
    )
    cases = [
        replace(GREEDY, max_tokens=8),
        replace(GREEDY, max_tokens=30, stop_token_ids=(tokens[k],)),
        replace(GREEDY, max_tokens=30, stop=(stop_text,)),
    ]
    for params in cases:
        want = run(Engine(runner, tokenizer), [(prompt, params)])[0]
        got = run(spec_engine(runner, tokenizer, "self", 5), [(prompt, params)])[0]
        assert {k_: v for k_, v in got.items() if k_ != "spec"} == {k_: v for k_, v in want.items() if k_ != "spec"}
        assert len(got["token_ids"]) % 6 != 1, "the stop should land inside a block, not at its end"
        check_stats(got["spec"], len(got["token_ids"]), 5)
    assert want["matched_stop"] == stop_text and got["token_ids"] != tokens


def test_seeded_sampling_repeats_and_reports_stats(runner, tokenizer, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=20, seed=123)
    requests = [(prompts[0], params), (prompts[3], replace(params, seed=7))]
    first = run(spec_engine(runner, tokenizer, "layerskip:2", 4), requests)
    again = run(spec_engine(runner, tokenizer, "layerskip:2", 4), list(reversed(requests)))[::-1]
    assert [r["token_ids"] for r in first] == [r["token_ids"] for r in again]
    for r in first:
        assert len(r["token_ids"]) == 20
        check_stats(r["spec"], 20, 4)


def test_simulated_acceptance_uses_floor_and_ceil_lengths(runner, tokenizer, prompts):
    engine = spec_engine(runner, tokenizer, "layerskip:1", 5, simulate=3.5)
    res = run(engine, [(p, replace(GREEDY, max_tokens=60, ignore_eos=True)) for p in prompts[:2]])
    for r in res:
        hist = r["spec"]["accept_histogram"]
        assert hist[2] + hist[3] == sum(hist) and abs(hist[2] - hist[3]) <= 1, hist  # accept lengths 3 and 4
    assert engine.decoder.describe()["simulate_acc_len"] == 3.5
