"""Skill `chat`: the other skills through the chat template, plus the tool-call and JSON replies the structured-
output features of the server constrain.

Chat examples are (messages, reply, tools) rather than completion text: `messages` go through the tokenizer's chat
template with the generation prompt, and the reply is the assistant's text. A tool call is spelled by the template's
`<|tool_call|>` marker followed by one JSON object `{"name": ..., "arguments": {...}}`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

from evalpipe.skills import Example, arith, copy_text, retrieval
from evalpipe.skills.words import ITEMS, NAMES

CODE_TOOL = {
    "type": "function",
    "function": {
        "name": "get_secret_code",
        "description": "Look up the secret code of a place.",
        "parameters": {"type": "object", "properties": {"place": {"type": "string"}}, "required": ["place"]},
    },
}
COUNT_TOOL = {
    "type": "function",
    "function": {
        "name": "count_items",
        "description": "Count how many items of a kind a person has.",
        "parameters": {
            "type": "object",
            "properties": {"person": {"type": "string"}, "item": {"type": "string"}},
            "required": ["person", "item"],
        },
    },
}
TOOLS = [CODE_TOOL, COUNT_TOOL]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}


@dataclass(frozen=True)
class ChatExample:
    skill: str
    identity: str
    messages: list
    reply: str  # the assistant's reply text (a tool call is `<|tool_call|>` + JSON)
    tools: list | None = None
    meta: dict = field(default_factory=dict)
    template_kwargs: dict = field(default_factory=dict)  # chat template switches, e.g. {"thinking": True}


def tool_call_text(name: str, arguments: dict) -> str:
    return "<|tool_call|>" + json.dumps({"name": name, "arguments": arguments})


def from_example(ex: Example) -> ChatExample:
    """A completion skill as one user turn and one assistant reply."""
    return ChatExample(
        f"chat-{ex.skill}", ex.identity, [{"role": "user", "content": ex.body}], ex.answer, meta=dict(ex.meta)
    )


def tool_call(rng: random.Random) -> ChatExample:
    """The user asks what a tool answers: the reply is the matching call, with the arguments taken from the ask."""
    if rng.random() < 0.5:
        place = retrieval_key(rng)
        ask = f"What is the secret code of the {place}?"
        call = tool_call_text("get_secret_code", {"place": place})
        identity = f"tool|code|{place}"
    else:
        (person, _), item = rng.choice(NAMES), rng.choice(ITEMS)
        ask = f"How many {item} does {person} have?"
        call = tool_call_text("count_items", {"person": person, "item": item})
        identity = f"tool|count|{person}|{item}"
    tools = rng.sample(TOOLS, len(TOOLS))
    return ChatExample("tool_call", identity, [{"role": "user", "content": ask}], call, tools=tools)


def tool_result(rng: random.Random) -> ChatExample:
    """After the call and the tool's result, the reply states the result."""
    base = tool_call(rng)
    ask = base.messages[0]["content"]
    value = str(rng.randint(10000, 99999)) if "code" in base.identity else str(rng.randint(0, 999))
    call = json.loads(base.reply[len("<|tool_call|>") :])
    messages = [
        {"role": "user", "content": ask},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0", "content": value},
    ]
    subject = ask[:-1].replace("What is", "").replace("How many", "").strip()
    reply = f"The answer is {value}." if rng.random() < 0.5 else value
    return ChatExample(
        "tool_result",
        base.identity + f"|{value}",
        messages,
        reply,
        tools=base.tools,
        meta={"expected": value, "subject": subject},
    )


def json_reply(rng: random.Random) -> ChatExample:
    """A fact in the user's text, asked back as a JSON object with the keys name and count."""
    (person, _), item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(0, 999)
    text = f"{person} has {count} {item}. Reply in JSON with the keys name and count."
    reply = json.dumps({"name": person, "count": count})
    return ChatExample(
        "json",
        f"json|{person}|{item}|{count}",
        [{"role": "user", "content": text}],
        reply,
        meta={"expected": {"name": person, "count": count}},
    )


def retrieval_key(rng: random.Random) -> str:
    from evalpipe.skills.words import ADJECTIVES, NOUNS

    return f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"


def generate(rng: random.Random) -> ChatExample:
    kind = rng.random()
    if kind < 0.35:
        return from_example(arith.generate(rng))
    if kind < 0.55:
        return from_example(retrieval.generate(rng, after=int(2 ** rng.uniform(3, 9)), before=rng.randint(0, 256)))
    if kind < 0.7:
        return from_example(copy_text.generate(rng))
    if kind < 0.82:
        return tool_call(rng)
    if kind < 0.92:
        return tool_result(rng)
    return json_reply(rng)
