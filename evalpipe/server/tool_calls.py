"""Tool calls out of a generated choice: content before the first marker token, then one call per marker.

The chat template spells a call as the marker token (`<|tool_call|>`, which decodes to no text) followed by
`{"name": ..., "arguments": {...}}`. The marker's place in the text is the length of the text of the tokens before
it, so the split works on the engine's own text. A call's `arguments` is the raw JSON text of the arguments value;
a call cut short (finish "length") or malformed after its name keeps what was generated, and a segment whose name
cannot be read at all stays content, so no protocol text is lost or invented.

`ToolCallSplitter` serves streamed and non-streamed responses alike: fed the choice's running token ids and text, it
returns the new content and the OpenAI `tool_calls` deltas (a call's id, type and name once, in its first fragment,
then pieces of its arguments); the pieces of one call, joined, equal the non-streamed `arguments`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

# the trained form: the name first, then the arguments
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_TAIL = re.compile(r"\s*\}\s*")


@dataclass
class _Call:
    id: str
    name: str | None = None
    args_start: int = 0  # where the arguments value starts in the call's text (-1: parsed whole, see `whole`)
    whole: str | None = None  # the arguments of a call written in another key order, re-serialised
    index: int = -1  # the OpenAI tool_calls index, once announced
    sent: int = 0  # characters of the arguments already returned
    final: str | None = None  # the arguments, once the call's text is complete


@dataclass
class ToolCallSplitter:
    """Splits one choice's output into content and tool calls, incrementally."""

    decode: Callable[[list[int]], str]
    marker: int
    parallel: bool = True
    _marks: list[int] = field(default_factory=list)  # text offsets of the markers seen
    _scanned: int = 0  # token ids already searched for markers
    _content_sent: int = 0
    _calls: list[_Call] = field(default_factory=list)
    _as_content: set = field(default_factory=set)  # segments that stayed content (no readable call)

    def feed(self, token_ids: list[int], text: str, final: bool) -> tuple[str, list[dict]]:
        """(new content, new tool_calls deltas) given everything generated so far; `final` at the choice's end."""
        for i in range(self._scanned, len(token_ids)):
            if token_ids[i] == self.marker:
                self._marks.append(len(self.decode(token_ids[:i])))
        self._scanned = len(token_ids)
        bounds = self._marks + [len(text)]
        content_end = bounds[0]
        deltas: list[dict] = []
        content_extra = ""
        for k, start in enumerate(self._marks):
            if not self.parallel and k > 0:
                break  # parallel_tool_calls false: only the first call is returned
            segment = text[start : bounds[k + 1]]
            done = final or k + 1 < len(self._marks)
            while len(self._calls) <= k:
                self._calls.append(_Call(id="call_" + uuid.uuid4().hex[:24]))
            call = self._calls[k]
            if call.name is None and not self._read_header(call, segment, done):
                if done and k not in self._as_content:
                    self._as_content.add(k)
                    content_extra += segment  # no call could be read: the text stays content
                continue
            deltas += self._advance(call, segment, done)
        content = text[self._content_sent : content_end] if content_end > self._content_sent else ""
        self._content_sent = max(self._content_sent, content_end)
        return content + content_extra, deltas

    @property
    def has_calls(self) -> bool:
        """A call has been announced (its first fragment returned)."""
        return bool(self._announced())

    def _announced(self) -> list[_Call]:
        return [c for c in self._calls if c.index >= 0]

    def _read_header(self, call: _Call, segment: str, done: bool) -> bool:
        m = _HEADER.match(segment)
        if m and (done or m.end() < len(segment)):  # the arguments have begun: the header's whitespace is complete
            call.name, call.args_start = json.loads(m.group(1)), m.end()
            return True
        if done:  # another key order: parse the whole object
            try:
                obj = json.loads(segment)
            except ValueError:
                return False
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
                call.name, call.args_start = obj["name"], -1
                call.whole = json.dumps(obj["arguments"], ensure_ascii=False)
                return True
        return False

    def _advance(self, call: _Call, segment: str, done: bool) -> list[dict]:
        out = []
        if call.index < 0:
            call.index = len(self._announced())
            out.append(
                {
                    "index": call.index,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                }
            )
        args = arguments_text(call, segment, done)
        if done:
            call.final = args
        piece = args[call.sent :]
        if piece:
            call.sent = len(args)
            out.append({"index": call.index, "function": {"arguments": piece}})
        return out

    def calls(self) -> list[dict]:
        """The finished calls as `message.tool_calls` (after the final feed)."""
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.final}}
            for c in self._announced()
            if c.final is not None
        ]


def arguments_text(call: _Call, segment: str, done: bool) -> str:
    """The arguments text known so far: all of it once the segment is done, else what surely belongs to it (up to
    the whitespace before the last `}`, which may be the closing brace of the call object)."""
    if call.args_start < 0:  # parsed whole, in another key order
        return call.whole or ""
    elif done:
        body = segment[call.args_start :]
        try:
            _, end = json.JSONDecoder().raw_decode(body)
            text = body[:end] if _TAIL.fullmatch(body[end:]) else body
        except ValueError:
            text = body
    else:
        body = segment[call.args_start :]
        last = body.rfind("}")
        text = body[: len(body[:last].rstrip())] if last >= 0 else ""
    return text
