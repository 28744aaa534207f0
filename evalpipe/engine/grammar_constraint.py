"""What a request may generate, as plain data: torch-free and hashable, so the HTTP process builds it from a request
(server/structured.py) and the engine process compiles and masks with it (engine/grammar.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class GrammarConstraint:
    """What a request may generate. `payload` is canonical JSON text, so equal specs hash (and cache) alike.

    kinds: "json" (payload: a JSON schema, or null for any JSON object), "tool_calls" (payload: {"marker": id,
    "calls": [[name, parameters schema], ...], "parallel": bool}: one call, or one or more, each the marker token
    then {"name": ..., "arguments": {...}}), "forbid" (payload: token ids free text may not contain)."""

    kind: str
    payload: str = "null"

    @classmethod
    def json(cls, schema: dict | None = None) -> "GrammarConstraint":
        return cls("json", _canonical(schema))

    @classmethod
    def tool_calls(cls, marker: int, calls: list[tuple[str, dict]], parallel: bool) -> "GrammarConstraint":
        return cls(
            "tool_calls", _canonical({"marker": marker, "calls": [[n, p] for n, p in calls], "parallel": parallel})
        )

    @classmethod
    def forbid(cls, token_ids: list[int]) -> "GrammarConstraint":
        return cls("forbid", _canonical(sorted(token_ids)))


def _canonical(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))  # key order kept: it is the order JSON is generated in
