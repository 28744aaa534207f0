"""From a validated OpenAI request to engine sequences, and from engine events to OpenAI responses or SSE chunks.

One request becomes `len(prompts) * n` sequences (choice index = prompt_index * n + i); a request with more
sequences than the queue could ever hold is a 400, not a retryable 503. The job is submitted to the engine process
(server/engine_client.py) and its events arrive on an asyncio queue; an engine that dies meanwhile is a 503.
While a request runs, a watcher waits on the connection itself; when the client goes
away (streamed or not) its unfinished sequences are aborted at once, so the engine drops them and frees their
runner slots before its next forward. A chat request's tools and response_format become a grammar on its
sampling params (structured.plan; compiled off the event loop before queueing, so a bad schema is a 400), and a
choice that may hold tool calls is split into content and `tool_calls` by tool_calls.ToolCallSplitter, streamed or not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from evalpipe import __version__
from evalpipe.engine.ipc import SeqEvent
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.server import structured
from evalpipe.server.engine_client import ENGINE_DEAD, EngineCallError, EngineDead
from evalpipe.server.errors import APIError, SafeJSONResponse, bad_request, json_bytes
from evalpipe.server.protocol import ChatCompletionRequest, CompletionRequest, check_unsupported
from evalpipe.server.tool_calls import ToolCallSplitter

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
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens()}}

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt like prompt_tokens (the best of its
        n choices: a later choice may hit the pages an earlier one just computed)."""
        n = max(1, self.n)
        return sum(max((c.cached_tokens for c in self.choices[i:i + n]), default=0)
                   for i in range(0, len(self.choices), n))


# -- request -> job -----------------------------------------------------------------------------------
def check_model(state, requested: str | None) -> None:
    if requested is None or requested in (state.model_id, state.settings.engine.model):
        return
    shown = requested if len(requested) <= 200 else requested[:200] + "..."
    raise APIError(404, f"The model `{shown}` does not exist (this server serves `{state.model_id}`).",
                   param="model", code="model_not_found")


def _sampling(state, req, max_tokens: int, logprobs: int | None, grammar=None,
              prompt_logprobs: int | None = None) -> SamplingParams:
    vocab = state.vocab_size
    stop_ids = tuple(req.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0),
        min_p=req.min_p, seed=req.seed, stop=tuple(req.stop_list()), stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos, logprobs=logprobs, grammar=grammar, min_tokens=req.min_output_tokens(),
        include_stop_str_in_output=req.keep_stop_text(), prompt_logprobs=prompt_logprobs,
    )


def _check_min_tokens(req, requested_max: int | None, grammar) -> None:
    """min_tokens must fit under max_tokens (vLLM's rule), and cannot hold a grammar open past its end."""
    least = req.min_output_tokens()
    if not least:
        return
    param = "min_new_tokens" if req.min_new_tokens and not req.min_tokens else "min_tokens"
    if requested_max is not None and least > requested_max:
        raise bad_request(f"{param} ({least}) must not exceed max_tokens ({requested_max})", param=param)
    if grammar is not None:
        raise bad_request(f"{param} cannot be combined with tools or response_format (a constrained answer ends "
                          "where its grammar does)", param=param)


def _truncate(state, ids: list[int], keep: int | None) -> list[int]:
    """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as leave room for one token)."""
    if keep is None:
        return ids
    limit = state.max_seq_len
    if keep > limit:
        raise bad_request(f"truncate_prompt_tokens ({keep}) exceeds the model's context of {limit} tokens",
                          param="truncate_prompt_tokens")
    keep = limit - 1 if keep == -1 else keep
    return ids[-keep:]


def _check_length(state, prompt: list[int], max_tokens: int | None, param: str) -> int:
    """The max_tokens to use: at most what the context leaves after the prompt (as SGLang's auto-truncate; the
    response then ends with finish_reason "length"). A prompt that leaves no room is a 400 context_length_exceeded."""
    limit = state.max_seq_len
    if len(prompt) >= limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your {param} has {len(prompt)} "
            "tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
            param=param, code="context_length_exceeded",
        )
    room = limit - len(prompt)
    return room if max_tokens is None else min(max_tokens, room)


def _check_batch(state, n_sequences: int, param: str) -> None:
    """A request is queued whole or not at all: one with more sequences than the queue holds can never run."""
    limit = state.engine.info.max_queue
    if n_sequences > limit:
        raise bad_request(f"this request needs {n_sequences} sequences (prompts x n) but the server queues at most "
                          f"{limit} (--max-queue); split it into smaller requests", param=param,
                          code="batch_too_large")


def _common(req) -> tuple[bool, bool]:
    unsupported = check_unsupported(req)
    if unsupported:
        raise bad_request(unsupported[1], param=unsupported[0])
    opts = req.stream_options
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


def chat_job(state, req: ChatCompletionRequest) -> Job:
    check_model(state, req.model)
    include_usage, continuous = _common(req)
    _check_batch(state, req.n, "n")
    plan = structured.plan(req, state.tokenizer)
    if plan.grammar is not None:
        blocker = state.engine.info.grammar_blocker
        if blocker:
            raise bad_request(f"constrained output (tools/response_format) is not available on this server: {blocker}",
                              param="response_format" if req.response_format else "tool_choice")
    try:
        messages = [template_message(m) for m in req.messages]
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    if plan.tools:
        kwargs["tools"] = plan.tools
    try:
        prompt = state.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except Exception as exc:
        raise bad_request(f"chat template failed: {exc}", param="messages") from None
    prompt = _truncate(state, prompt, req.truncate_prompt_tokens)
    _check_min_tokens(req, req.max_completion_tokens or req.max_tokens, plan.grammar)
    max_tokens = _check_length(state, prompt, req.max_completion_tokens or req.max_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Job(
        chat=True, model=state.model_id, prompts=[prompt],
        params=[_sampling(state, req, max_tokens, logprobs, plan.grammar)],
        n=req.n, stream=req.stream, include_usage=include_usage, continuous_usage=continuous,
        return_token_ids=req.return_token_ids, want_logprobs=req.logprobs, tool_marker=plan.tool_marker,
        parallel_tool_calls=plan.parallel,
        grammar_param="response_format" if req.response_format and req.response_format.type != "text" else "tools",
    )


def template_message(m) -> dict:
    """One message as the chat template reads it (an assistant's tool calls and a tool turn's call id included)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": c.function.arguments}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def completion_job(state, req: CompletionRequest) -> Job:
    check_model(state, req.model)
    include_usage, continuous = _common(req)
    vocab = state.vocab_size
    try:
        raw = req.prompts()
    except ValueError as exc:
        raise bad_request(str(exc), param="prompt") from None
    _check_batch(state, len(raw) * req.n, "prompt" if len(raw) > 1 else "n")
    prompts: list[list[int]] = []
    texts: list[str] = []
    encode = state.tokenizer.encode_prompt if req.add_special_tokens else state.tokenizer.encode
    for p in raw:
        # a text prompt gets the tokenizer's BOS (add_special_tokens); token ids are taken verbatim, as in vLLM
        ids = encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise bad_request("prompt must contain at least one token", param="prompt")
        if any(not 0 <= t < vocab for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", param="prompt")
        truncated = _truncate(state, ids, req.truncate_prompt_tokens)
        prompts.append(truncated)
        texts.append(p if isinstance(p, str) and truncated is ids else state.tokenizer.decode(truncated))
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    _check_min_tokens(req, max_tokens, None)
    generate = max_tokens > 0
    scored = req.scored_prompt_top()
    params = [_sampling(state, req, _check_length(state, p, max(max_tokens, 1), "prompt"), req.logprobs,
                        prompt_logprobs=scored) for p in prompts]
    return Job(
        chat=False, model=state.model_id, prompts=prompts, params=params, n=req.n, stream=req.stream,
        include_usage=include_usage, continuous_usage=continuous, return_token_ids=req.return_token_ids,
        want_logprobs=req.logprobs is not None, echo=req.echo, prompt_texts=texts, generate=generate,
        prompt_logprobs=req.prompt_logprobs,
    )


# -- running -----------------------------------------------------------------------------------------
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
        raise bad_request(f"the {job.grammar_param} schema cannot be used for constrained decoding: {exc}",
                          param=job.grammar_param, code="invalid_schema") from None


async def submit(state, job: Job) -> None:
    try:
        job.rid, job.queue = await state.engine.submit(job.prompts, job.params, job.n)
    except EngineDead as exc:
        raise engine_gone(exc) from None
    except EngineCallError as exc:
        if exc.kind == "queue_full":
            raise APIError(503, f"The server is overloaded: {exc}. Retry later.", code="queue_full",
                           headers={"Retry-After": RETRY_AFTER_S}) from None
        if exc.kind == "grammar":
            raise bad_request(f"the {job.grammar_param} schema cannot be used for constrained decoding: {exc}",
                              param=job.grammar_param, code="invalid_schema") from None
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
            while isinstance(event, SeqEvent) and event.finish_reason is None and not event.error \
                    and not job.queue.empty():
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


async def respond(state, job: Job, request: Request):
    await compile_grammar(state, job)
    await submit(state, job)
    if job.stream:
        return StreamingResponse(_sse(state, job, request), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    async for ev in events(state, job, request):
        if ev.error:
            raise APIError(500, f"generation failed: {ev.error}", type="server_error")
    if job.disconnected:  # nobody is listening; uvicorn drops what is sent to a closed connection
        return APIError(499, "client closed the connection; generation aborted", type="invalid_request_error",
                        code="client_disconnected").response()
    return SafeJSONResponse(_full_response(state, job))


def _full_response(state, job: Job) -> dict:
    choices = []
    for i, c in enumerate(job.choices):
        choice: dict[str, Any] = {"index": i}
        finish = _finish(c.finish_reason)
        if job.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
            if job.tool_marker is not None:
                splitter = _splitter(state, job)
                content, _ = splitter.feed(c.token_ids, c.text, final=True)
                calls = splitter.calls()
                if calls:
                    choice["message"] = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = "tool_calls" if finish == "stop" else finish
            choice["logprobs"] = _chat_logprobs(state, c.logprobs) if job.want_logprobs else None
        elif job.echo:
            prompt_index = i // max(job.n, 1)
            choice["text"] = job.prompt_texts[prompt_index] + c.text
            top = job.params[prompt_index].logprobs or 0
            choice["logprobs"] = _legacy_logprobs(state, _prompt_entries(c, top) + c.logprobs, 0) \
                if job.want_logprobs else None
        else:
            choice["text"] = c.text
            choice["logprobs"] = _legacy_logprobs(state, c.logprobs, 0) if job.want_logprobs else None
        if job.prompt_logprobs is not None:
            choice["prompt_logprobs"] = _vllm_prompt_logprobs(state, c.prompt_logprobs or [], job.prompt_logprobs)
        matched = c.matched_stop
        if not job.generate:  # nothing generated: the prompt was only scored
            finish, matched = "length", None
        choice.update(finish_reason=finish, matched_stop=matched, spec=c.spec)
        if job.return_token_ids:
            choice["prompt_token_ids"] = c.prompt_ids
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    return {
        "id": job.id, "object": "chat.completion" if job.chat else "text_completion", "created": job.created,
        "model": job.model, "system_fingerprint": fingerprint(state), "choices": choices, "usage": job.usage(),
    }


async def _sse(state, job: Job, request: Request) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if job.chat else "text_completion"
    with_usage = job.include_usage or job.continuous_usage

    def chunk(choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": job.id, "object": obj, "created": job.created, "model": job.model,
                "system_fingerprint": fingerprint(state), "choices": choices}
        if with_usage:
            body["usage"] = usage if usage is not None else (job.usage() if job.continuous_usage else None)
        return _data(body)

    started: set[int] = set()
    splitters = {i: _splitter(state, job) for i in range(len(job.choices))} if job.tool_marker is not None else {}
    if job.chat:  # the role comes first, before any token, as in OpenAI's streams
        for i, c in enumerate(job.choices):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            if job.return_token_ids:
                first["prompt_token_ids"] = c.prompt_ids
            started.add(i)
            yield chunk([first])
    stream = events(state, job, request)
    complete = False
    try:
        while True:
            try:
                ev = await stream.__anext__()
            except StopAsyncIteration:
                complete = True
                break
            except APIError as exc:  # the engine process died: the error is the stream's last event
                yield _data(exc.body())
                break
            if ev.error:
                err = APIError(500, f"generation failed: {ev.error}", type="server_error").body()
                yield _data(err)
                break
            if not ev.token_ids and ev.finish_reason is None:
                continue
            c = job.choices[ev.index]
            offset = len(c.text) - len(ev.text)
            choice: dict[str, Any] = {"index": ev.index}
            finish = _finish(ev.finish_reason)
            if job.chat:
                choice["delta"] = {"content": ev.text}
                if ev.index in splitters:
                    splitter = splitters[ev.index]
                    content, calls = splitter.feed(c.token_ids, c.text, final=ev.finish_reason is not None)
                    choice["delta"] = ({"content": content} if content or not splitter.has_calls else {}) | (
                        {"tool_calls": calls} if calls else {})
                    if splitter.calls() and finish == "stop":
                        finish = "tool_calls"
                choice["logprobs"] = _chat_logprobs(state, ev.logprobs or []) if job.want_logprobs else None
            else:
                choice["text"] = ev.text
                choice["logprobs"] = _legacy_logprobs(state, ev.logprobs or [], offset) if job.want_logprobs else None
            choice["finish_reason"] = finish
            choice["matched_stop"] = ev.matched_stop
            if ev.finish_reason is not None:
                choice["spec"] = ev.spec
            if job.return_token_ids:
                choice["token_ids"] = ev.token_ids
                if ev.index not in started:
                    choice["prompt_token_ids"] = c.prompt_ids
            started.add(ev.index)
            yield chunk([choice])
    finally:
        await stream.aclose()
    if complete and job.include_usage and not job.disconnected:
        yield chunk([], job.usage())
    if not job.disconnected:
        yield b"data: [DONE]\n\n"


def _splitter(state, job: Job) -> ToolCallSplitter:
    return ToolCallSplitter(decode=state.tokenizer.decode, marker=job.tool_marker, parallel=job.parallel_tool_calls)


def _data(body: dict) -> bytes:
    """One SSE event: a single `data:` line (json_bytes escapes every character a reader could split on)."""
    return b"data: " + json_bytes(body) + b"\n\n"


def _finish(reason: str | None) -> str | None:
    return None if reason is None else ("stop" if reason == "abort" else reason)


# -- logprobs ----------------------------------------------------------------------------------------
def _token_bytes(state, token_id: int) -> list[int]:
    tb = getattr(state.tokenizer, "token_bytes", None)
    return list(tb(token_id)) if tb is not None else list(state.tokenizer.token_text(token_id).encode())


def _chat_logprobs(state, entries: list[dict]) -> dict:
    text = state.tokenizer.token_text
    content = []
    for e in entries:
        content.append({
            "token": text(e["id"]), "logprob": e["logprob"], "bytes": _token_bytes(state, e["id"]),
            "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": _token_bytes(state, t)} for t, lp in e["top"]],
        })
    return {"content": content}


def _legacy_logprobs(state, entries: list[dict], offset: int) -> dict:
    """OpenAI's legacy completions shape; an entry {"id": t, "logprob": None} (an echoed prompt's first token) has
    a null logprob and null top_logprobs, as in OpenAI's and vLLM's echo."""
    text = state.tokenizer.token_text
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        tokens.append(text(e["id"]))
        lps.append(e["logprob"])
        tops.append(None if e["logprob"] is None else {text(t): lp for t, lp in e["top"]})
        offsets.append(offset)
        offset += len(state.tokenizer.decode([e["id"]]))
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _prompt_entries(c: Choice, top_k: int) -> list[dict]:
    """The echoed prompt's logprob entries with their top `top_k`: the first token's logprob is None."""
    scored = c.prompt_logprobs or [None] * len(c.prompt_ids)
    return [{"id": t, "logprob": None, "top": []} if e is None else {**e, "top": e["top"][:top_k]}
            for t, e in zip(c.prompt_ids, scored)]


def _vllm_prompt_logprobs(state, scored: list[dict | None], top_k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt token and the top k (ranked 1..k)."""
    text = state.tokenizer.token_text
    out: list[dict | None] = []
    for e in scored:
        if e is None:
            out.append(None)
            continue
        entry = {str(e["id"]): {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": text(e["id"])}}
        for rank, (t, lp) in enumerate(e["top"][:top_k], start=1):
            entry.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": text(t)})
        out.append(entry)
    return out


def fingerprint(state) -> str:
    return f"evalpipe-{__version__}-{state.model_id}-{state.settings.engine.dtype}-{state.settings.engine.device}"
