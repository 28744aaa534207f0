"""A streamed chunk is built from a head encoded once per stream and the chunk's own fields (server/responses.py
`_chunk_head`, `_chunk`); on random payloads (unicode, JSON escapes, line separators, lone surrogates, None, finite
floats, big ints, nesting) its bytes are those of the whole body encoded at once, and `json_bytes` writes what
json.dumps writes, with the line separators escaped."""

from __future__ import annotations

import json
import math
import random

import pytest

from evalpipe.server.errors import json_bytes
from evalpipe.server.responses import _chunk, _chunk_head, _data

PIECES = ["a", "Z", " ", '"', "\\", "/", "\n", "\r", "\t", "\x00", "\x1f", "\x7f", "\x85", "\u2028", "\u2029", "é"]
PIECES += ["中", "😀", "\ud800", "\udfff", "<|tool_call|>", "data: ", "\n\n"]


def text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))


def value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["str", "int", "float", "none", "bool"] + (["list", "dict"] if depth < 3 else []))
    if kind == "str":
        return text(rng)
    if kind == "int":
        return rng.choice([0, -1, 2**64 + 1, rng.randint(-(10**9), 10**9)])
    if kind == "float":
        return rng.choice([0.0, -0.0, 5e-324, 1.7e308, -math.pi, rng.uniform(-1e6, 1e6)])
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return fields(rng, "", depth + 1, least=0)


def fields(rng: random.Random, prefix: str, depth: int = 0, least: int = 1) -> dict:
    return {prefix + text(rng): value(rng, depth) for _ in range(rng.randint(least, 5))}


def dumps_bytes(obj) -> bytes:
    """What json_bytes promises, written with json.dumps itself."""
    out = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    for char, escape in (("\x85", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        out = out.replace(char, escape)
    return out.encode("utf-8", "backslashreplace")


def test_a_chunk_is_the_whole_body_encoded_at_once():
    for seed in range(500):
        rng = random.Random(seed)
        head, rest = fields(rng, "h"), fields(rng, "r")  # disjoint keys, as a chunk's fields never repeat the head's
        whole = {**head, **rest}
        got = _chunk(_chunk_head(head), rest)
        assert got == _data(whole), seed
        assert got == b"data: " + dumps_bytes(whole) + b"\n\n", seed
        assert got.count(b"\n") == 2 and got.endswith(b"\n\n"), seed  # one line, whatever the payload holds


def test_json_bytes_writes_what_json_dumps_writes():
    for seed in range(500):
        obj = value(random.Random(seed))
        assert json_bytes(obj) == dumps_bytes(obj), seed


def test_json_bytes_refuses_what_json_cannot_hold():
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            json_bytes({"choices": [{"logprob": bad}]})
