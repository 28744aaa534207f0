"""A generation request on its way through the engine: the `Job` and its `Choice`s, and the steps that run it.

The job is submitted to the engine process (server/engine_client.py), its grammar compiled there first (off the
event loop, so a bad schema is a 400), and its events arrive on an asyncio queue; an engine that dies meanwhile
is a 503. While a request runs, a watcher waits on the connection itself; when the client goes away (streamed or
not) its unfinished sequences are aborted at once, so the engine drops them and frees their runner slots before
its next forward.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from fastapi import Request

from evalpipe.engine.ipc import SeqEvent
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.server.engine_client import ENGINE_DEAD, EngineCallError, EngineDead
from evalpipe.server.errors import APIError, bad_request

RETRY_AFTER_S = "1"
DISCONNECTED = object()  # put on a job's event queue by its disconnect watcher


@dataclass
class Choice:
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    spec: dict | None = None
    cached_tokens: int = 0
    prompt_logprobs: list[dict | None] | None = None  # per prompt token (engine/ipc.py SeqEvent), when scored


@dataclass
class Job:
    """One HTTP generation request on its way through the engine."""

    chat: bool
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # per prompt
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    want_logprobs: bool
    tool_marker: int | None = None  # parse tool calls behind this token (chat requests with tools)
    parallel_tool_calls: bool = True
    grammar_param: str | None = None  # the request field a grammar came from (named by a compile error)
    echo: bool = False  # completions: the prompt (text, tokens, logprobs) leads each choice
    prompt_texts: list[str] = field(default_factory=list)  # per prompt, what echo shows
    generate: bool = True  # False: max_tokens 0 with echo; the one token the engine makes is dropped
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field on each choice: its top k
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    rid: int | None = None  # the engine's name for this request, once submitted
    queue: asyncio.Queue | None = None
    disconnected: bool = False

    def __post_init__(self):
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.choices = [Choice(prompt_ids=p) for p in self.prompts for _ in range(self.n)]

    def usage(self) -> dict:
        """The usage object. Streams with continuous_usage_stats build one per chunk, so the sums run over lists
        (less per call than generator expressions)."""
        prompt = sum(map(len, self.prompts))
        completion = sum([len(c.token_ids) for c in self.choices])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        }

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt like prompt_tokens (the best of its
        n choices: a later choice may hit the pages an earlier one just computed)."""
        n = max(1, self.n)
        cached = [c.cached_tokens for c in self.choices]
        if n == 1:
            return sum(cached)
        return sum(max(cached[i : i + n]) for i in range(0, len(cached), n))


def engine_gone(exc: Exception) -> APIError:
    return APIError(503, f"the engine process died: {exc}", type="server_error", code="engine_dead")


async def compile_grammar(state, job: Job) -> None:
    """Compile the job's grammar in the engine process (off its step loop, cached per spec) before queueing; a
    schema xgrammar cannot take is a 400."""
    spec = job.params[0].grammar if job.params else None
    if spec is None:
        return
    try:
        await state.engine.call("compile", spec, timeout=None)
    except EngineDead as exc:
        raise engine_gone(exc) from None
    except EngineCallError as exc:
        if exc.kind != "grammar":
            raise
        raise bad_request(
            f"the {job.grammar_param} schema cannot be used for constrained decoding: {exc}",
            param=job.grammar_param,
            code="invalid_schema",
        ) from None


async def submit(state, job: Job) -> None:
    try:
        job.rid, job.queue = await state.engine.submit(job.prompts, job.params, job.n)
    except EngineDead as exc:
        raise engine_gone(exc) from None
    except EngineCallError as exc:
        if exc.kind == "queue_full":
            raise APIError(
                503,
                f"The server is overloaded: {exc}. Retry later.",
                code="queue_full",
                headers={"Retry-After": RETRY_AFTER_S},
            ) from None
        if exc.kind == "grammar":
            raise bad_request(
                f"the {job.grammar_param} schema cannot be used for constrained decoding: {exc}",
                param=job.grammar_param,
                code="invalid_schema",
            ) from None
        raise


async def _watch_disconnect(state, job: Job, request: Request) -> None:
    """Wait on the connection (the body is already read, so the next ASGI message is the disconnect); then abort
    the job's sequences and wake its reader. Runs for the whole request, streamed or not."""
    while (await request.receive())["type"] != "http.disconnect":
        await asyncio.sleep(0.05)  # not expected (the body is read); never spin if a server repeats a message
    job.disconnected = True
    state.engine.abort(job.rid)
    job.queue.put_nowait(DISCONNECTED)


async def events(state, job: Job, request: Request | None) -> AsyncIterator[SeqEvent]:
    """The job's engine events until every choice has finished or the client left; aborts the rest when the caller
    stops early. Raises the 503 APIError when the engine process dies meanwhile.

    Events of one choice that queued up while the reader was busy come out merged into one (`SeqEvent.then`): a
    reader that keeps up sees one event per engine step, one that falls behind (64 streams at GPU decode rates)
    catches up in fewer, larger chunks instead of falling further behind, as vLLM's output collector does. Token
    counts stay exact (every chunk carries its token ids)."""
    remaining = len(job.choices)
    watcher = asyncio.ensure_future(_watch_disconnect(state, job, request)) if request is not None else None
    held: Any = None  # an event taken off the queue while merging that belongs to the next round
    try:
        while remaining:
            if held is not None:
                event, held = held, None
            else:
                event = job.queue.get_nowait() if not job.queue.empty() else await job.queue.get()
            while (
                isinstance(event, SeqEvent)
                and event.finish_reason is None
                and not event.error
                and not job.queue.empty()
            ):
                nxt = job.queue.get_nowait()
                if isinstance(nxt, SeqEvent) and nxt.index == event.index and not nxt.error:
                    event = event.then(nxt)
                else:
                    held = nxt
                    break
            if event is DISCONNECTED:
                return
            if event is ENGINE_DEAD:
                raise engine_gone(state.engine_error or "it exited")
            if event.finish_reason is not None:
                remaining -= 1
            _apply(job, event)
            yield event
    finally:
        if watcher is not None:
            watcher.cancel()
        if remaining:
            state.engine.abort(job.rid)
        else:
            state.engine.release(job.rid)


def _apply(job: Job, ev: SeqEvent) -> None:
    c = job.choices[ev.index]
    if ev.prompt_logprobs is not None:
        c.prompt_logprobs = ev.prompt_logprobs
    if not job.generate:  # max_tokens 0: the engine's one token is not part of the answer
        ev = replace(ev, token_ids=[], text="", logprobs=None)
    c.text += ev.text
    c.token_ids += ev.token_ids
    c.cached_tokens = ev.cached_tokens
    if ev.logprobs:
        c.logprobs += ev.logprobs
    if ev.finish_reason is not None:
        c.finish_reason, c.matched_stop, c.spec = ev.finish_reason, ev.matched_stop, ev.spec
