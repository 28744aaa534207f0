"""Tool calls and response formats through the real server and the real `openai` client: the trained default model
under block speculation (so the grammar masks every verify row), one server for the module.

tool_choice auto, required and named return the expected calls (name and arguments) with finish_reason
"tool_calls", content null and no protocol text anywhere; "none" never emits the marker; a tool result is answered
in words; a response_format JSON schema is met; streamed fragments join to the non-streamed arguments; eight
requests at once all hold; malformed values are 400s that name the field."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from evalpipe.skills import chat
from tests.support.server_harness import ServerProcess, torch_loaded

MODEL = "evalpipe-skills-dsv4"
MARKER = 10  # <|tool_call|>
COMMON = {"model": MODEL, "temperature": 0, "max_tokens": 100}  # a call takes about 70


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--speculative", "block", "--max-batch", "8", model=MODEL)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=120)


def examples(kind, count, seed=16):
    rng = random.Random(seed)
    return [getattr(chat, kind)(rng) for _ in range(count)]


def expected_call(ex) -> dict:
    return json.loads(ex.reply[len("<|tool_call|>") :])


def ask(client, ex, **kwargs):
    return client.chat.completions.create(
        messages=ex.messages, **{**COMMON, "tools": chat.TOOLS, **kwargs}, extra_body={"return_token_ids": True}
    )


def assert_clean_call(choice, name: str, arguments: dict | None = None):
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content is None
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    if arguments is not None:
        assert args == arguments
    assert "<|" not in call.function.arguments
    assert choice.model_extra["token_ids"].count(MARKER) == 1  # one call, the marker once
    return args


def tool_calls(name: str, count: int, seed: int = 16) -> list:
    """Tool questions whose reply calls `name`. The default model copies count_items' person and item exactly; it
    picks get_secret_code rightly but often misspells the place (its training receipt: tool_call exact 0.56)."""
    pool = examples("tool_call", 8 * count, seed)
    return [ex for ex in pool if expected_call(ex)["name"] == name][:count]


def at_once(fn, items) -> list:
    """fn over items, all requests in flight together (batched by the server: faster than one by one)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(fn, items))


def test_tool_call_has_the_expected_name_and_arguments(client):
    """auto and required: count_items calls exactly as asked; a get_secret_code call has its one string argument."""
    cases = [
        (ex, mode)
        for mode in ("auto", "required")
        for ex in tool_calls("count_items", 2) + tool_calls("get_secret_code", 1)
    ]
    for (ex, _), choice in zip(cases, at_once(lambda c: ask(client, c[0], tool_choice=c[1]).choices[0], cases)):
        call = expected_call(ex)
        exact = call["name"] == "count_items"
        args = assert_clean_call(choice, call["name"], call["arguments"] if exact else None)
        assert set(args) == set(call["arguments"]) and all(isinstance(v, str) for v in args.values())


def test_named_tool_choice_fixes_the_function(client):
    """Naming count_items on a secret-code question still yields a count_items call whose arguments fit its schema;
    naming the right function (with parallel_tool_calls false) yields the expected call."""
    wrong, right = tool_calls("get_secret_code", 1)[0], tool_calls("count_items", 1, seed=4)[0]
    call = expected_call(right)
    requests = [(wrong, "count_items"), (right, call["name"])]
    choices = at_once(
        lambda r: ask(
            client, r[0], parallel_tool_calls=False, tool_choice={"type": "function", "function": {"name": r[1]}}
        ).choices[0],
        requests,
    )
    args = assert_clean_call(choices[0], "count_items")
    assert set(args) == {"person", "item"} and all(isinstance(v, str) for v in args.values())
    assert_clean_call(choices[1], call["name"], call["arguments"])


def test_tool_choice_none_never_calls(client):
    ex = examples("tool_call", 1)[0]
    choice = ask(client, ex, tool_choice="none").choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert MARKER not in choice.model_extra["token_ids"]
    assert isinstance(choice.message.content, str) and "<|" not in choice.message.content


def test_tool_result_continuation_states_the_result(client):
    exs = examples("tool_result", 2)
    for ex, choice in zip(exs, at_once(lambda e: ask(client, e).choices[0], exs)):
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert ex.meta["expected"] in choice.message.content
        assert "<|" not in choice.message.content and MARKER not in choice.model_extra["token_ids"]


def test_streamed_tool_call_joins_to_the_non_streamed_arguments(client):
    ex = tool_calls("count_items", 1, seed=3)[0]
    whole = ask(client, ex, tool_choice="required").choices[0].message.tool_calls[0]
    stream = client.chat.completions.create(
        messages=ex.messages, **COMMON, tools=chat.TOOLS, tool_choice="required", stream=True
    )
    fragments, finishes, content = [], [], ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            fragments += c.delta.tool_calls or []
            finishes += [c.finish_reason] if c.finish_reason else []
    assert finishes == ["tool_calls"] and content == ""
    head = fragments[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == whole.function.name and head.function.arguments == ""
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments[1:])
    assert "".join(f.function.arguments for f in fragments) == whole.function.arguments


def test_response_format_json_schema_streamed_and_not(client):
    ex = examples("json_reply", 1)[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "fact", "schema": chat.JSON_SCHEMA, "strict": True}}
    # a schema the model was not trained on is still met: the mask decides the shape
    other = {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        },
        "required": ["ok", "tags"],
    }
    formats = [fmt, {"type": "json_schema", "json_schema": {"name": "o", "schema": other}}, {"type": "json_object"}]
    fact, shaped, anything = at_once(
        lambda f: client.chat.completions.create(messages=ex.messages, **COMMON, response_format=f).choices[0], formats
    )
    assert fact.finish_reason == "stop"
    assert json.loads(fact.message.content) == ex.meta["expected"]
    if shaped.finish_reason == "stop":
        obj = json.loads(shaped.message.content)
        assert set(obj) == {"ok", "tags"} and isinstance(obj["ok"], bool) and len(obj["tags"]) <= 2
    else:
        assert shaped.finish_reason == "length"
    assert isinstance(json.loads(anything.message.content), dict)
    stream = client.chat.completions.create(messages=ex.messages, **COMMON, response_format=fmt, stream=True)
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert text == fact.message.content


def test_eight_concurrent_structured_requests(client):
    calls = tool_calls("count_items", 2, seed=5) + tool_calls("get_secret_code", 2, seed=5)
    facts = examples("json_reply", 4, seed=5)
    fmt = {"type": "json_schema", "json_schema": {"name": "fact", "schema": chat.JSON_SCHEMA}}

    def one(i):
        if i % 2 == 0:
            ex = calls[i // 2]
            choice = ask(client, ex, tool_choice="required").choices[0]
            return choice.finish_reason, choice.message.tool_calls[0].function.name, expected_call(ex)["name"]
        ex = facts[i // 2]
        choice = client.chat.completions.create(messages=ex.messages, **COMMON, response_format=fmt).choices[0]
        return choice.finish_reason, json.loads(choice.message.content), ex.meta["expected"]

    results = at_once(one, range(8))
    for i, (finish, got, want) in enumerate(results):
        assert finish == ("tool_calls" if i % 2 == 0 else "stop")
        assert got == want


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": chat.TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tools": chat.TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": chat.TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": chat.TOOLS + chat.TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
        "response_format",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tool_choice": "required",
        },
        "tools",
    ),
    ({"tools": chat.TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("fields,param", BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_malformed_values_are_400_naming_the_field(server, fields, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    r = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_completions_route_refuses_tools(server):
    r = httpx.post(
        server.base + "/v1/completions",
        timeout=30,
        json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "tools": chat.TOOLS},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_the_http_process_never_imports_torch(server):
    """After the structured, speculative and malformed requests above, the HTTP process has not loaded torch (grammar
    specs, speculation settings and the engine's events are torch-free); its engine process has."""
    assert torch_loaded(server.engine_pid())
    assert not torch_loaded(server.proc.pid), "the HTTP process imported torch (find where: python -X importtime)"
