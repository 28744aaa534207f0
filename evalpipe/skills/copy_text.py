"""Skill `copy`: reproduce a random string longer than WINDOW (64) characters, exactly.

Each character of the copy lies more than WINDOW tokens after its source, so a window-64 model copies through its
compressed attention layers (the window-256 default model has the lane's strings inside its window). Training also
draws strings inside the window and, with `lead`, starts the question after a lead-in of up to `lead` characters,
so the string's place relative to the compressed blocks (4 and 16 tokens) varies.
"""

from __future__ import annotations

import random
import string

from evalpipe.skills import WINDOW, Example

ALPHABET = string.ascii_lowercase + string.digits
LENGTHS = (WINDOW + 8, 2 * WINDOW + 32)  # inclusive range of string lengths
LENGTH_GROUPS = [(WINDOW + 32, "short"), (2 * WINDOW, "medium"), (LENGTHS[1], "long")]


LEAD_IN = "Here is a string to copy. Read it once and write it back. "  # lead-ins are its prefixes


def generate(rng: random.Random, length: int | None = None, lead: int = 0) -> Example:
    """A string of `length` characters (default: LENGTHS); `lead` > 0 puts a lead-in of 0..lead characters first."""
    length = length or rng.randint(*LENGTHS)
    text = "".join(rng.choice(ALPHABET) for _ in range(length))
    group = next((label for bound, label in LENGTH_GROUPS if length <= bound), LENGTH_GROUPS[-1][1])
    prefix = LEAD_IN[: rng.randint(0, min(lead, len(LEAD_IN)))] if lead else ""
    return Example(
        "copy",
        f"copy|{text}",
        f"{prefix}Copy the text exactly: {text}",
        text,
        group=group,
        meta={"length": length, "expected": text},
    )
