"""Splitting generated text into content and tool calls (server/tool_calls.py), on byte-tokenizer token streams fed
in every chunking: the streamed deltas join to exactly the non-streamed call, content before the marker stays
content, parallel calls get distinct indices and ids, and text that holds no readable call is never lost."""

from __future__ import annotations

import json

import pytest

from evalpipe.engine.tokenizer import ByteTokenizer
from evalpipe.server.tool_calls import ToolCallSplitter

TOK = ByteTokenizer()
MARKER = TOK.tool_call_token_id
CALL = '{"name": "count_items", "arguments": {"person": "Ava", "item": "shells {x}"}}'


def ids(text: str) -> list[int]:
    return TOK.encode(text) + [TOK.eos_token_id]


def split(token_ids: list[int], chunk: int | None, parallel: bool = True):
    """Feed the splitter as a stream in pieces of `chunk` tokens (None: once, non-streamed)."""
    splitter = ToolCallSplitter(decode=TOK.decode, marker=MARKER, parallel=parallel)
    content, deltas = "", []
    steps = [len(token_ids)] if chunk is None else list(range(chunk, len(token_ids), chunk)) + [len(token_ids)]
    for end in steps:
        c, d = splitter.feed(token_ids[:end], TOK.decode(token_ids[:end]), final=end == len(token_ids))
        content += c
        deltas += d
    return content, deltas, splitter.calls()


def joined(deltas: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in out and d["type"] == "function" and d["function"]["arguments"] == ""
            out[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "arguments": ""}
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            out[d["index"]]["arguments"] += d["function"]["arguments"]
    return out


@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 7, 40])
def test_streamed_fragments_join_to_the_call(chunk):
    content, deltas, calls = split(ids("<|tool_call|>" + CALL), chunk)
    assert content == ""
    assert len(calls) == 1 and calls[0]["function"]["name"] == "count_items"
    assert json.loads(calls[0]["function"]["arguments"]) == {"person": "Ava", "item": "shells {x}"}
    assert calls[0]["function"]["arguments"] == '{"person": "Ava", "item": "shells {x}"}'
    stream = joined(deltas)
    assert stream == {0: {"id": calls[0]["id"], "name": "count_items", "arguments": calls[0]["function"]["arguments"]}}


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_content_before_the_call_and_parallel_calls(chunk):
    other = '{"name": "get_secret_code", "arguments": {"place": "pale market"}}'
    token_ids = ids("Let me check.<|tool_call|>" + CALL + "<|tool_call|>" + other)
    content, deltas, calls = split(token_ids, chunk)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["count_items", "get_secret_code"]
    assert len({c["id"] for c in calls}) == 2
    stream = joined(deltas)
    assert [stream[i]["arguments"] for i in (0, 1)] == [c["function"]["arguments"] for c in calls]
    _, _, first_only = split(token_ids, chunk, parallel=False)
    assert [c["function"]["name"] for c in first_only] == ["count_items"]


def test_other_key_order_and_unreadable_calls():
    _, _, calls = split(ids('<|tool_call|>{"arguments": {"a": 1}, "name": "f"}'), None)
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    for chunk in (None, 1):
        content, deltas, calls = split(ids("<|tool_call|>not a call"), chunk)
        assert calls == [] and deltas == [] and content == "not a call"  # kept as text, the marker not shown


def test_a_call_cut_short_keeps_what_was_generated():
    cut = "<|tool_call|>" + CALL[:50]
    for chunk in (None, 3):
        _, deltas, calls = split(TOK.encode(cut), chunk)
        assert calls[0]["function"]["arguments"] == CALL[CALL.index('{"person') : 50]
        assert joined(deltas)[0]["arguments"] == CALL[CALL.index('{"person') : 50]
