"""`--stream-interval N` (engine/output.py `deliver`): after a sequence's first token its events carry N tokens, the
last one possibly fewer; tokens, text, stops and finish reasons are those of N = 1. Checked on the engine with the tiny
model (length ends on and off the interval, a stop string, speculation-free sampling) and through a real `evalpipe
serve` with the openai client (streamed chunks, and the non-streamed text they add up to)."""

from __future__ import annotations

import openai
import pytest

from evalpipe.engine.engine import Engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence
from evalpipe.engine.tokenizer import load_tokenizer
from tests.support.server_harness import ServerProcess


def run(tiny_runner, interval: int, jobs: list[tuple[list[int], dict]]) -> list[list]:
    engine = Engine(
        tiny_runner(max_seqs=4, max_seq_len=256),
        load_tokenizer(None),
        max_batch=4,
        max_tokens_per_step=64,
        stream_interval=interval,
    )
    logs: list[list] = [[] for _ in jobs]
    seqs = [
        Sequence(prompt=prompt, params=SamplingParams(**params), on_event=logs[i].append)
        for i, (prompt, params) in enumerate(jobs)
    ]
    engine.submit(seqs)
    while engine.busy:
        engine.step()
    return logs


def merged(events: list) -> tuple:
    return (
        [t for ev in events for t in ev.token_ids],
        "".join(ev.text for ev in events),
        events[-1].finish_reason,
        events[-1].completion_tokens,
    )


def test_events_carry_the_interval_and_the_same_output(tiny_runner):
    jobs = [
        ([5, 6, 7, 8] * 4, dict(temperature=0.0, max_tokens=13, ignore_eos=True)),  # 1 + 4 + 4 + 4: ends on it
        ([9, 10, 11] * 5, dict(temperature=0.0, max_tokens=15, ignore_eos=True)),  # 1 + 4 + 4 + 4 + 2
        ([12, 13] * 9, dict(temperature=0.8, seed=3, max_tokens=11, ignore_eos=True)),  # sampled: 1 + 4 + 4 + 2
    ]
    plain, grouped = run(tiny_runner, 1, jobs), run(tiny_runner, 4, jobs)
    for one, four in zip(plain, grouped):
        assert merged(one) == merged(four)
        assert all(len(ev.token_ids) == 1 for ev in one)
    assert [len(ev.token_ids) for ev in grouped[0]] == [1, 4, 4, 4]
    assert [len(ev.token_ids) for ev in grouped[1]] == [1, 4, 4, 4, 2]
    assert [len(ev.token_ids) for ev in grouped[2]] == [1, 4, 4, 2]
    assert all(ev.finish_reason is None for log in grouped for ev in log[:-1])
    assert [log[-1].finish_reason for log in grouped] == ["length"] * 3


def test_a_stop_string_inside_a_held_group_ends_it_with_the_same_text(tiny_runner):
    free = run(tiny_runner, 1, [([40, 41, 42] * 6, dict(temperature=0.0, max_tokens=40, ignore_eos=True))])[0]
    text = merged(free)[1]
    stop = text[9:12]  # a stop string that first appears some tokens in, inside a held group
    assert stop and text.find(stop) > 0
    jobs = [([40, 41, 42] * 6, dict(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]))]
    one, eight = run(tiny_runner, 1, jobs)[0], run(tiny_runner, 8, jobs)[0]
    assert merged(one) == merged(eight)
    assert merged(eight)[1] == text[: text.find(stop)] and eight[-1].finish_reason == "stop"
    assert len(eight) < len(one)


def test_an_interval_below_one_is_refused(tiny_runner):
    with pytest.raises(ValueError):
        Engine(tiny_runner(max_seqs=1, max_seq_len=64), load_tokenizer(None), stream_interval=0)


def test_served_streams_come_in_chunks_of_the_interval():
    server = ServerProcess("--max-batch", "2", "--max-seq-len", "256", "--stream-interval", "5")
    try:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
        body = dict(
            model=client.models.list().data[0].id,
            prompt="2 + 3 =",
            max_tokens=17,
            temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        whole = client.completions.create(**body)
        chunks = [c for c in client.completions.create(stream=True, **body) if c.choices]
        sizes = [len(c.choices[0].model_extra["token_ids"]) for c in chunks]
        assert sizes == [1, 5, 5, 5, 1]
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 17
    finally:
        server.stop()
