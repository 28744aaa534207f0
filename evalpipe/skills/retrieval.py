"""Skill `retrieval`: one key-value pair hidden in numbered filler notes, asked for at the end.

The needle (`The secret code of the violet harbor is 48213.`) sits anywhere from inside the sliding window to the far
start of the model's context. The filler notes carry numbers of their own, so the value has to be found by its key,
not by being the only number. `depth` is the distance in bytes (= tokens) from the value to the end of the prompt.
"""

from __future__ import annotations

import random

from evalpipe.skills import WINDOW, Example
from evalpipe.skills.words import ADJECTIVES, NOTE_WORDS, NOUNS

MAX_CONTEXT = 4096  # the default model's context in tokens (BOS + bytes), prompt and reply together
REPLY_ROOM = 32  # tokens kept free for the reply
# reporting buckets by depth: (upper bound in tokens, label)
DEPTH_GROUPS = [(WINDOW, "in-window"), (256, "d256"), (1024, "d1024"), (2048, "d2048"), (MAX_CONTEXT, "deepest")]


def note(i: int, rng: random.Random) -> str:
    a, b = rng.sample(NOTE_WORDS, 2)
    return f"Note {i}: the {a} near the {b} was counted {rng.randint(1, 99)} times."


def _notes(n_bytes: int, rng: random.Random, first: int) -> list[str]:
    """Whole notes until they add up to at least n_bytes (newlines included)."""
    out, total = [], 0
    while total < n_bytes:
        out.append(note(first + len(out), rng))
        total += len(out[-1]) + 1
    return out


def generate(
    rng: random.Random, after: int | None = None, before: int | None = None, context: int = MAX_CONTEXT, digits: int = 5
) -> Example:
    """after: bytes of filler between the needle and the question (default log-uniform up to the context);
    before: bytes of filler ahead of the needle (default random, within the context); context: the prompt and
    reply budget in bytes (a longer-context server is qualified with longer prompts); digits: the code's length."""
    key = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}"
    value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    limit = context - REPLY_ROOM - 200  # filler bytes that fit beside the needle and the question
    if after is None:
        after = 0 if rng.random() < 0.15 else int(2 ** rng.uniform(3, 11.9))
    after = min(after, limit)
    if before is None:
        before = rng.randint(0, min(limit - after, 2 * after + 64))
    needle = f"The secret code of the {key} is {value}."
    notes_before = _notes(before, rng, 0)
    notes_after = _notes(after, rng, len(notes_before))
    while notes_before and len("\n".join(notes_before + notes_after)) > limit:
        notes_before.pop(0)  # whole notes past the context go from the front
    body = (
        "Read the notes.\n"
        + "\n".join(notes_before + [needle] + notes_after)
        + f"\nWhat is the secret code of the {key}?"
    )
    ex = Example("retrieval", f"retrieval|{key}|{value}", body, value, group="", meta={"key": key})
    depth = len(ex.prompt) - ex.prompt.index(f" is {value}.") - 4
    return Example(
        ex.skill,
        ex.identity,
        body,
        value,
        group=depth_group(depth),
        meta={"key": key, "depth": depth, "expected": value},
    )


def depth_group(depth: int) -> str:
    for bound, label in DEPTH_GROUPS:
        if depth <= bound:
            return label
    return DEPTH_GROUPS[-1][1]
