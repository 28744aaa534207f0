"""Skill `tools`: a tool call whose tool and arguments are drawn per example, the arguments taken from the ask.

Each example offers two or three tools named `<verb>_<noun>` with one to three parameters (strings or integers); the
user asks to `<verb> the <noun>` with each parameter's value spelled in the ask. The reply is the chat skill's call
form (`<|tool_call|>{"name": ..., "arguments": {...}}`, arguments in the schema's order), so the server's tool-call
parser reads it. String values are words or random codes of 1 to 24 characters, so a call copies text exactly.
"""

from __future__ import annotations

import random
import string

from evalpipe.skills.chat import ChatExample, tool_call_text
from evalpipe.skills.words import ADJECTIVES, ITEMS, NAMES, NOUNS

VERBS = ["get", "find", "book", "send", "check", "open", "close", "count", "list", "cancel", "update", "track"]
# parameter name -> kind of value: "word" (from the word lists), "code" (random letters and digits) or "integer"
PARAMETERS = {
    "city": "word",
    "person": "word",
    "color": "word",
    "place": "word",
    "item": "word",
    "code": "code",
    "ticket": "code",
    "label": "code",
    "count": "integer",
    "amount": "integer",
    "year": "integer",
    "level": "integer",
}
CODE_CHARS = string.ascii_lowercase + string.digits
CODE_LENGTHS = (1, 24)


def _word(rng: random.Random) -> str:
    return rng.choice([rng.choice(NAMES)[0], rng.choice(ITEMS), rng.choice(ADJECTIVES), rng.choice(NOUNS)])


def _value(kind: str, rng: random.Random):
    if kind == "integer":
        return rng.randint(0, 10 ** rng.randint(1, 4) - 1)
    if kind == "code":
        return "".join(rng.choice(CODE_CHARS) for _ in range(rng.randint(*CODE_LENGTHS)))
    return _word(rng)


def tool_spec(name: str, params: list[str]) -> dict:
    verb, noun = name.split("_", 1)
    props = {p: {"type": "integer" if PARAMETERS[p] == "integer" else "string"} for p in params}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{verb.capitalize()} a {noun}.",
            "parameters": {"type": "object", "properties": props, "required": list(params)},
        },
    }


def generate(rng: random.Random) -> ChatExample:
    names, n_tools = set(), rng.randint(2, 3)
    while len(names) < n_tools:
        names.add(f"{rng.choice(VERBS)}_{rng.choice(NOUNS)}")
    names = sorted(names)
    rng.shuffle(names)
    tools = [tool_spec(n, rng.sample(sorted(PARAMETERS), rng.randint(1, 3))) for n in names]
    chosen = rng.choice(tools)["function"]
    params = list(chosen["parameters"]["properties"])
    arguments = {p: _value(PARAMETERS[p], rng) for p in params}
    verb, noun = chosen["name"].split("_", 1)
    ask = f"Please {verb} the {noun} with " + ", ".join(f"{p} {arguments[p]}" for p in params) + "."
    identity = f"tools|{chosen['name']}|" + "|".join(f"{p}={arguments[p]}" for p in params)
    return ChatExample(
        "tools",
        identity,
        [{"role": "user", "content": ask}],
        tool_call_text(chosen["name"], arguments),
        tools=tools,
        meta={"expected": {"name": chosen["name"], "arguments": arguments}},
    )
