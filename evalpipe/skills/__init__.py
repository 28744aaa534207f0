"""Seeded synthetic skills: the one definition of the tasks the default model is trained on and scored on.

Training (`training/train_default_model.py`) and the lanes (`arith`, `retrieval`, `copy`) draw from the same
generators, so what is scored is exactly the format that was taught. Each generator turns a `random.Random` into an
`Example`. Every example has an `identity` (its content without incidental filler); a fixed hash of the identity
assigns it to the training or the held-out split (`split_of`), so the two can never share an item, whatever seeds
either side uses.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Callable

# The distance (tokens = bytes here) long-range parts of an item lie beyond: the window-64 model's sliding window,
# which the items were drawn for. Changing it changes every lane's items and their pins; the window-256 default model
# sees the copy lane's strings inside its own window.
WINDOW = 64
HELDOUT_BUCKETS = 16  # one identity hash bucket in 16 is held out


@dataclass(frozen=True)
class Example:
    """One task instance: `body` is the question, `answer` the exact reply (no leading space, no end marker).

    As a completion it is `Question: {body}\\nAnswer:` followed by ` {answer}`; in chat, body is the user message
    and answer the assistant's. `group` is the reporting bucket (number of operations, retrieval depth, length).
    """

    skill: str
    identity: str
    body: str
    answer: str
    group: str
    meta: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return completion_prompt(self.body)

    @property
    def completion(self) -> str:
        return " " + self.answer


def completion_prompt(body: str) -> str:
    return f"Question: {body}\nAnswer:"


def split_of(identity: str) -> str:
    """'heldout' for one identity bucket in HELDOUT_BUCKETS, else 'train' (sha256, so stable across machines)."""
    bucket = int.from_bytes(hashlib.sha256(identity.encode()).digest()[:4], "big") % HELDOUT_BUCKETS
    return "heldout" if bucket == 0 else "train"


def draw(
    generator: Callable[[random.Random], Example], rng: random.Random, split: str, max_tries: int = 1000
) -> Example:
    """The next example of `split` from `generator` (rejecting the other split's identities)."""
    for _ in range(max_tries):
        ex = generator(rng)
        if split_of(ex.identity) == split:
            return ex
    raise RuntimeError(f"no {split} example in {max_tries} draws")  # pragma: no cover - 1/16 odds per draw
