"""What every gate shares: one qualification's settings, the endpoint it talks to, and the record of each request.

The endpoint speaks through harness/client.py only (the real `openai` client for plain requests, its SSE reader for
streamed ones, `Server` for the routes beside generation), so qualify sends exactly what `run` would send. Retries
are off: a qualification counts every failure, it does not hide one behind a retry.

A request's record (`exchange`) holds the body sent, the normalised output (text, token ids, finish reason, logprobs,
tool calls), its checks (each `{"name", "ok", "detail"}`) and its verdict: pass when every check holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from evalpipe.harness import client as http
from evalpipe.harness.client import Server

# Text of the chat template's tool protocol (evalpipe's byte-level template, and the common ones of open models):
# none of it may reach a reply's content or a call's arguments.
PROTOCOL_MARKERS = (
    "<|tool_call|>",
    "<|end|>",
    "<|assistant|>",
    "<|tool|>",
    "<|user|>",
    "<|system|>",
    "<tool_call>",
    "</tool_call>",
    "<|tool_calls_section_begin|>",
    "<｜tool▁call▁begin｜>",
)


# The most characters of a server's own text (an error body, an exception) kept in a record: enough for any
# actionable message an engine writes, bounded so that a server answering megabytes cannot bloat qualify.json.
MESSAGE_LIMIT = 4000


def bounded(text: Any) -> str:
    """A server's text as records keep it: whole up to MESSAGE_LIMIT characters, else cut with a marker saying so."""
    text = str(text)
    if len(text) <= MESSAGE_LIMIT:
        return text
    return text[:MESSAGE_LIMIT] + f" ... [{len(text) - MESSAGE_LIMIT} more characters in the server's reply]"


@dataclass
class QualifyConfig:
    base_url: str
    out_dir: Path
    gates: tuple[str, ...]
    model: Optional[str] = None
    api_keys: tuple[str, ...] = ()
    max_context: int = 4096
    concurrency: int = 8
    max_tokens: int = 32  # greedy continuation length of the boundaries and mixed gates
    timeout_s: float = 600.0
    retrieval_depths: int = 4
    needles_per_depth: int = 2
    receipt: Optional[Path] = None  # the launch receipt of the server (server_sizes.py reads its sizes)
    kv_pool_tokens: Optional[int] = None  # the KV pool kv-pressure fills; None: what the server exposes
    retrieval_prompt_form: str = "auto"  # retrieval's prompts: auto, chat or completions (qualify/retrieval.py)
    chunk_size: Optional[int] = None
    page_size: Optional[int] = None
    sliding_window: Optional[int] = None
    compress_ratios: tuple[int, ...] = ()
    soak_s: float = 120.0
    hang_s: float = 60.0
    soak_max_tokens: int = 64
    sample_every_s: float = 2.0
    sampling_tokens: int = 12000  # sampled tokens the sampling gate tests
    sampling_seed: int = 0  # its prompts, its PIT randomisation and the requests' seeds
    record_reference: Optional[Path] = None
    reference: Optional[Path] = None
    progress: bool = True
    command_line: list = field(default_factory=list)

    @property
    def api_key(self) -> Optional[str]:
        """The key generation requests carry (the first one given)."""
        return self.api_keys[0] if self.api_keys else None


def check(name: str, ok: bool, detail: Any = "") -> dict:
    return {
        "name": name,
        "ok": bool(ok),
        "detail": detail if isinstance(detail, (str, int, float)) else bounded(json.dumps(detail, default=str)),
    }


def exchange(
    rid: str, kind: str, body: Optional[dict], outcome: Optional["Outcome"], checks: list[dict], **extra: Any
) -> dict:
    """One request's record. A request that failed in transport or status gets that as its first check."""
    record: dict[str, Any] = {"id": rid, "kind": kind, "body": body}
    if outcome is not None:
        record.update(outcome.record())
    record.update(extra)
    record["checks"] = checks
    record["verdict"] = "pass" if checks and all(c["ok"] for c in checks) else "fail"
    return record


@dataclass
class GateResult:
    name: str
    records: list = field(default_factory=list)
    wall_s: float = 0.0
    problem: Optional[str] = None  # a gate-level failure: nothing could be tested, or a setting is missing
    notes: dict = field(default_factory=dict)
    skipped: Optional[str] = None  # why the gate does not apply to this server (not a failure)

    @property
    def passed(self) -> int:
        return sum(r["verdict"] == "pass" for r in self.records)

    @property
    def failed(self) -> int:
        return len(self.records) - self.passed

    @property
    def verdict(self) -> str:
        if self.skipped:
            return "skipped"
        return "pass" if self.problem is None and self.records and not self.failed else "fail"

    @property
    def reason(self) -> str:
        """Why the gate failed, whole: its problem, else the first failed check (never cut: it is the message a
        user acts on)."""
        if self.skipped or self.problem:
            return self.skipped or self.problem
        for r in self.records:
            for c in r["checks"]:
                if not c["ok"]:
                    return f"{r['id']}: {c['name']}: {c['detail']}"
        return "" if self.records else "no requests"

    def to_json(self) -> dict:
        return {
            "gate": self.name,
            "verdict": self.verdict,
            "reason": self.reason,
            "requests": len(self.records),
            "passed": self.passed,
            "failed": self.failed,
            "wall_s": round(self.wall_s, 3),
            "notes": self.notes,
            "records": self.records,
        }


# ---------------------------------------------------------------------------------------------- outputs


@dataclass
class Outcome:
    """What one request came back with, streamed or not, in one shape."""

    ok: bool
    status: Optional[int] = None
    error: Optional[str] = None
    latency_s: float = 0.0
    text: str = ""
    token_ids: Optional[list] = None
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None  # one float per output token, when asked for
    top_logprobs: Optional[list] = None  # one {token: logprob} per output token, when asked for
    tokens: Optional[list] = None  # the output tokens as text pieces, when the server gives logprobs
    tool_calls: Optional[list] = None  # [{"name", "arguments"}] (arguments as the server's string)
    usage: Optional[dict] = None
    n_events: Optional[int] = None
    max_gap_s: Optional[float] = None
    hung: bool = False
    started_at: float = 0.0
    ended_at: float = 0.0

    def record(self) -> dict:
        out = {
            "ok": self.ok,
            "status": self.status,
            "error": self.error,
            "latency_s": round(self.latency_s, 4),
            "output": {
                "text": self.text,
                "token_ids": self.token_ids,
                "finish_reason": self.finish_reason,
                "tool_calls": self.tool_calls,
                "logprobs": self.logprobs,
            },
            "usage": self.usage,
        }
        if self.n_events is not None:
            out.update(n_events=self.n_events, max_gap_s=round(self.max_gap_s or 0.0, 4), hung=self.hung)
        return out

    def transport_check(self) -> dict:
        return check("answered", self.ok, "HTTP 200" if self.ok else (self.error or f"HTTP {self.status}"))


def _logprob_lists(lp: Any, chat: bool) -> tuple[Optional[list], Optional[list], Optional[list]]:
    """(token texts, logprobs, top logprobs) from a completions or chat `logprobs` object."""
    if not isinstance(lp, dict):
        return None, None, None
    if chat:
        content = lp.get("content") or []
        return (
            [c.get("token") for c in content],
            [c.get("logprob") for c in content],
            [{t.get("token"): t.get("logprob") for t in c.get("top_logprobs") or []} for c in content],
        )
    return lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")


def _calls(raw: Any) -> Optional[list]:
    if not raw:
        return None
    calls = []
    for c in raw:
        fn = (c or {}).get("function") or {}
        calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
    return calls


def outcome_of_reply(reply: http.Reply, chat: bool) -> Outcome:
    if reply.data is None:
        err = reply.error or {}
        return Outcome(False, err.get("status"), f"{err.get('type')}: {bounded(err.get('message'))}", reply.latency_s)
    choice = reply.data["choices"][0]
    if chat:
        msg = choice.get("message") or {}
        text, calls = msg.get("content") or "", _calls(msg.get("tool_calls"))
    else:
        text, calls = choice.get("text") or "", None
    tokens, lps, tops = _logprob_lists(choice.get("logprobs"), chat)
    return Outcome(
        True,
        200,
        None,
        reply.latency_s,
        text,
        choice.get("token_ids"),
        choice.get("finish_reason"),
        lps,
        tops,
        tokens,
        calls,
        reply.data.get("usage"),
    )


class StreamPieces:
    """What the events of one stream add up to: token ids, logprobs and tool calls (text, usage and finish reason
    go straight onto the Outcome)."""

    def __init__(self):
        self.ids: list = []
        self.tokens: list = []
        self.lps: list = []
        self.tops: list = []
        self.calls: dict[int, dict] = {}
        self.got_ids = self.got_lp = False

    def add(self, event: dict, chat: bool, out: Outcome) -> bool:
        """Take one event's choices into `out` and here; whether it carried output (text or token ids)."""
        if event.get("usage"):
            out.usage = event["usage"]
        produced = False
        for choice in event.get("choices") or []:
            piece = self._delta_text(choice) if chat else choice.get("text") or ""
            out.text += piece
            if choice.get("token_ids") is not None:
                self.got_ids = True
                self.ids += choice["token_ids"]
            t, chunk_lps, tp = _logprob_lists(choice.get("logprobs"), chat)
            if chunk_lps is not None:
                self.got_lp = True
                self.tokens += t or []
                self.lps += chunk_lps
                self.tops += tp or []
            if choice.get("finish_reason"):
                out.finish_reason = choice["finish_reason"]
            produced = produced or bool(piece or choice.get("token_ids"))
        return produced

    def _delta_text(self, choice: dict) -> str:
        delta = choice.get("delta") or {}
        for tc in delta.get("tool_calls") or []:
            slot = self.calls.setdefault(tc.get("index", 0), {"name": None, "arguments": ""})
            fn = tc.get("function") or {}
            if fn.get("name"):
                slot["name"] = (slot["name"] or "") + fn["name"]
            slot["arguments"] += fn.get("arguments") or ""
        return delta.get("content") or ""

    def finish(self, out: Outcome) -> None:
        out.token_ids = self.ids if self.got_ids else None
        out.logprobs, out.tokens, out.top_logprobs = (
            (self.lps, self.tokens, self.tops) if self.got_lp else (None, None, None)
        )
        out.tool_calls = [self.calls[i] for i in sorted(self.calls)] or None


def same_output(a: Outcome, b: Outcome) -> tuple[bool, str]:
    """Greedy outputs agree: the same token ids when both carry them, else the same text (and finish reason)."""
    if a.token_ids is not None and b.token_ids is not None:
        if a.token_ids != b.token_ids:
            return False, f"token ids differ from position {first_divergence(a.token_ids, b.token_ids)}"
    if a.text != b.text:
        return (
            False,
            f"text differs from character {first_divergence(a.text, b.text)}: {a.text[:60]!r} vs {b.text[:60]!r}",
        )
    if a.finish_reason != b.finish_reason:
        return False, f"finish reason {a.finish_reason} vs {b.finish_reason}"
    return True, f"{len(a.token_ids or a.text)} {'tokens' if a.token_ids is not None else 'characters'} agree"


def cached_tokens(out: Outcome) -> Optional[int]:
    """usage.prompt_tokens_details.cached_tokens (prompt tokens served from the prefix cache), None when the server
    does not report it (vLLM reports it with --enable-prompt-tokens-details)."""
    details = (out.usage or {}).get("prompt_tokens_details")
    value = details.get("cached_tokens") if isinstance(details, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def first_divergence(a, b) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def leaked_protocol(*texts: Optional[str]) -> list[str]:
    return sorted({m for t in texts if t for m in PROTOCOL_MARKERS if m in t})


# ---------------------------------------------------------------------------------------------- endpoint


class Endpoint:
    """The server under qualification: plain and streamed generation, cache flushes, its reported settings."""

    def __init__(self, cfg: QualifyConfig, model: str, facts: dict, sizes: Optional[dict] = None):
        self.cfg = cfg
        self.model = model
        self.facts = facts  # {"models", "server_info_path", "server_info"} (redacted)
        self.sizes = sizes or {}  # server_sizes.gather: boundary sizes and KV pool the server exposes
        self.base_url = cfg.base_url.rstrip("/")
        self._n = 0

    @property
    def info(self) -> Any:
        return self.facts.get("server_info")

    async def __aenter__(self) -> "Endpoint":
        self._clients = http.openai_clients(
            self.base_url, self.cfg.api_key, self.cfg.timeout_s, max(self.cfg.concurrency, 9)
        )
        self._streamer = http.streaming_client(self.cfg.api_key, self.cfg.timeout_s, max(self.cfg.concurrency, 9))
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self._clients:
            await c.close()
        await self._streamer.close()

    def body(self, **fields: Any) -> dict:
        return {"model": self.model, **fields}

    async def send(self, body: dict, chat: bool) -> Outcome:
        """One request, streamed when the body says `stream: true`."""
        if body.get("stream"):
            return await self.stream(body, chat)
        self._n += 1
        client = self._clients[self._n % len(self._clients)]
        started = time.time()
        reply = await http.send(
            client,
            "/chat/completions" if chat else "/completions",
            body,
            chat=chat,
            max_retries=0,
            backoff_s=0.0,
            secrets=self.cfg.api_keys,
        )
        out = outcome_of_reply(reply, chat)
        out.started_at, out.ended_at = started, time.time()
        return out

    async def stream(
        self, body: dict, chat: bool, hang_s: Optional[float] = None, on_first: Optional[asyncio.Event] = None
    ) -> Outcome:
        """A streamed request read to `[DONE]`; `hung` when no event came for `hang_s` seconds (then it is closed).
        `on_first` is set when the first output arrives (a decode is running)."""
        url = self.base_url + ("/chat/completions" if chat else "/completions")
        out = Outcome(False, started_at=time.time(), n_events=0, max_gap_s=0.0, text="")
        pieces = StreamPieces()
        t0 = last = time.perf_counter()
        done = False
        try:
            async with contextlib.aclosing(http.sse_json(self._streamer, url, body)) as events:
                while True:
                    try:
                        event = (
                            await asyncio.wait_for(events.__anext__(), hang_s) if hang_s else await events.__anext__()
                        )
                    except StopAsyncIteration:
                        done = True
                        break
                    now = time.perf_counter()
                    out.max_gap_s, last = max(out.max_gap_s or 0.0, now - last), now
                    out.n_events += 1
                    if isinstance(event, dict) and event.get("error") and not event.get("choices"):
                        out.error = f"error event: {bounded(json.dumps(event['error']))}"
                        break
                    if pieces.add(event, chat, out) and on_first is not None:
                        on_first.set()
        except asyncio.TimeoutError:
            out.hung = True
            out.error = f"no event for {hang_s:g} s (hang)"
        except http.StreamRefused as exc:
            out.status, out.error = exc.status, f"HTTP {exc.status}: {bounded(exc.text)}"
        except Exception as exc:  # transport errors, a body that is not SSE JSON: a failed request, never a crash
            out.error = f"{type(exc).__name__}: {bounded(exc)}"
        out.latency_s = time.perf_counter() - t0
        out.ended_at = time.time()
        if on_first is not None:
            on_first.set()
        if out.error is None and not done:
            out.error = "stream ended without [DONE]"
        if out.error is None and out.finish_reason is None:
            out.error = "stream ended without a finish reason"
        out.ok = out.error is None
        out.status = out.status or (200 if out.ok or out.hung or out.n_events else None)
        pieces.finish(out)
        return out

    def flush(self) -> Optional[str]:
        """Drop the server's prefix cache; the route that did it, or None when it has none."""
        with Server(self.base_url, self.cfg.api_key) as server:
            return server.reset_prefix_cache()

    async def aflush(self) -> Optional[str]:
        return await asyncio.to_thread(self.flush)


async def gather_limited(coros: list, limit: int) -> list:
    """Run coroutines with at most `limit` in flight; results in order."""
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def read_json_file(path: Path) -> Any:
    return json.loads(Path(path).read_text())
