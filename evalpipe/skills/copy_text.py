"""Skill `copy`: reproduce a random string longer than the sliding window, exactly.

Each character of the copy lies more than WINDOW tokens after its source, so copying goes through the compressed
attention layers.
"""

from __future__ import annotations

import random
import string

from evalpipe.skills import WINDOW, Example

ALPHABET = string.ascii_lowercase + string.digits
LENGTHS = (WINDOW + 8, 2 * WINDOW + 32)  # inclusive range of string lengths
LENGTH_GROUPS = [(WINDOW + 32, "short"), (2 * WINDOW, "medium"), (LENGTHS[1], "long")]


def generate(rng: random.Random, length: int | None = None) -> Example:
    length = length or rng.randint(*LENGTHS)
    text = "".join(rng.choice(ALPHABET) for _ in range(length))
    group = next(label for bound, label in LENGTH_GROUPS if length <= bound)
    return Example(
        "copy",
        f"copy|{text}",
        f"Copy the text exactly: {text}",
        text,
        group=group,
        meta={"length": length, "expected": text},
    )
