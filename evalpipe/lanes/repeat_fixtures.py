"""The fixed fixtures of the repeatability protocol (`evalpipe repeat`), each sent N times at temperature 0.

Two controls with checkable answers tell a broken server from a merely non-deterministic one. They are asked in the
formats of evalpipe.skills (`arith`'s one-operation drill and `copy`) and graded exactly: the last number must be
155, the reply's first line must be the copied text and nothing else. The default model answers the arithmetic
control, so against it a wrong one is a server fault, not a weak model (tests/harness/test_repeat.py checks it); a
regex-shaped answer checks format; a short open prompt shows where greedy outputs fork (the classic
"Tell me about Richard Feynman" probe); the same prompt behind a long padding exercises long-context
prefill and, on servers with a prefix cache, cached-versus-fresh prefixes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Callable, Optional

from evalpipe.skills import completion_prompt

DEFAULT_LONG_CONTEXT_CHARS = 6000

OPEN_PROMPT = "Tell me about Richard Feynman."


@dataclass(frozen=True)
class Fixture:
    id: str
    kind: str  # "control" (checkable answer), "format" (regex-shaped) or "open"
    prompt: str
    max_tokens: int
    expected: Optional[str]  # what a correct answer contains, for controls and format fixtures
    extract: Optional[Callable[[str], Optional[str]]]  # pulls the graded part out of the completion

    def grade(self, text: str) -> tuple[Optional[str], Optional[bool]]:
        """(extracted answer, correct) for checkable fixtures; (None, None) for open prompts."""
        if self.extract is None:
            return None, None
        got = self.extract(text)
        if self.kind == "format":
            return got, got is not None
        return got, got == self.expected

    def describe(self) -> dict:
        return {
            "id": self.id,
            "kind": self.kind,
            "max_tokens": self.max_tokens,
            "expected": self.expected,
            "prompt_chars": len(self.prompt),
            "prompt_sha256": hashlib.sha256(self.prompt.encode()).hexdigest(),
        }


def _last_int(text: str) -> Optional[str]:
    """The legacy GSM8K reading (last run of digits), which takes the `#### N` line of a worked answer."""
    nums = re.findall(r"\d+", text.replace(",", ""))
    return nums[-1] if nums else None


def _answer_line(text: str) -> Optional[str]:
    """The reply's first line, stripped: an exact copy is that line and nothing more (`copy`'s answer format)."""
    lines = text.strip().splitlines()
    return lines[0].strip() if lines and lines[0].strip() else None


def _iso_date(text: str) -> Optional[str]:
    m = re.search(r"\b\d{4}-\d{2}-\d{2}\b", text)
    return m.group(0) if m else None


def padding(n_chars: int) -> str:
    """Deterministic filler of exactly n_chars characters: numbered, varied lines (no hash-like repeats)."""
    words = ("river", "lantern", "granite", "orchard", "meadow", "copper", "harbor", "thistle", "violet", "summit")
    lines, total, i = [], 0, 0
    while total < n_chars:
        line = f"Note {i}: the {words[i % 10]} near the {words[(i * 7 + 3) % 10]} was counted {i * 13 % 97} times.\n"
        lines.append(line)
        total += len(line)
        i += 1
    return "".join(lines)[:n_chars]


COPY_TEXT = "k3v9x0pq"


def fixtures(long_context_chars: int = DEFAULT_LONG_CONTEXT_CHARS, open_max_tokens: int = 64) -> list[Fixture]:
    return [
        Fixture(
            "arithmetic",
            "control",
            completion_prompt("What is 120 + 35?"),
            max_tokens=96,
            expected="155",
            extract=_last_int,
        ),
        Fixture(
            "exact_copy",
            "control",
            completion_prompt(f"Copy the text exactly: {COPY_TEXT}"),
            max_tokens=16,
            expected=COPY_TEXT,
            extract=_answer_line,
        ),
        Fixture(
            "regex_date",
            "format",
            "Write a date in ISO format (YYYY-MM-DD).\nDate: 1999-12-31\n\nWrite another date in ISO format "
            "(YYYY-MM-DD).\nDate:",
            max_tokens=12,
            expected=r"\d{4}-\d{2}-\d{2}",
            extract=_iso_date,
        ),
        Fixture("open_short", "open", OPEN_PROMPT, max_tokens=open_max_tokens, expected=None, extract=None),
        Fixture(
            "open_long_context",
            "open",
            padding(long_context_chars) + "\n\n" + OPEN_PROMPT,
            max_tokens=open_max_tokens,
            expected=None,
            extract=None,
        ),
    ]


def fixtures_sha256(items: list[Fixture]) -> str:
    """One hash over the fixture set as sent (ids, prompts, max_tokens)."""
    blob = json.dumps([[f.id, f.prompt, f.max_tokens] for f in items], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()
