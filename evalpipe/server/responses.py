"""From engine events to OpenAI response bodies: the whole response, or SSE chunks as the events arrive.

Both shapes build each choice through `choice_body`, from a `ChoicePart` (the whole choice, or the piece of it one
event carried), so a field means the same in a response and in a stream. A choice that may hold tool calls is
split into content and `tool_calls` by tool_calls.ToolCallSplitter, streamed or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request

from evalpipe import __version__
from evalpipe.server.errors import APIError, json_bytes
from evalpipe.server.jobs import Choice, Job, events
from evalpipe.server.tool_calls import ToolCallSplitter


@dataclass
class ChoicePart:
    """What one response body says of one choice: all of it (a full response) or one event's piece (a stream)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict]
    finish_reason: str | None
    matched_stop: int | str | None
    spec: dict | None
    text_offset: int = 0  # where `text` starts in the choice's text (completions logprobs' text_offset)
    first: bool = True  # the first body that carries this choice (its prompt_token_ids go there)


def choice_body(state, job: Job, part: ChoicePart, splitter: ToolCallSplitter | None, stream: bool) -> dict:
    """One entry of `choices`: a `message` (full) or `delta` (stream) for chat, `text` for completions; the stats
    (`spec`) ride on the final piece; prompt_logprobs only on a full response."""
    c = job.choices[part.index]
    choice: dict[str, Any] = {"index": part.index}
    finish = _finish(part.finish_reason)
    if job.chat:
        message: dict[str, Any] = {"content": part.text} if stream else {"role": "assistant", "content": part.text}
        if splitter is not None:
            content, calls = splitter.feed(c.token_ids, c.text, final=not stream or part.finish_reason is not None)
            if stream:
                message = ({"content": content} if content or not splitter.has_calls else {}) | (
                    {"tool_calls": calls} if calls else {}
                )
            elif splitter.calls():
                message = {"role": "assistant", "content": content or None, "tool_calls": splitter.calls()}
            if splitter.calls() and finish == "stop":
                finish = "tool_calls"
        choice["delta" if stream else "message"] = message
        choice["logprobs"] = _chat_logprobs(state, part.logprobs) if job.want_logprobs else None
    else:
        choice["text"] = part.text
        choice["logprobs"] = _legacy_logprobs(state, part.logprobs, part.text_offset) if job.want_logprobs else None
    if job.prompt_logprobs is not None and not stream:
        choice["prompt_logprobs"] = _vllm_prompt_logprobs(state, c.prompt_logprobs or [], job.prompt_logprobs)
    choice["finish_reason"] = finish
    choice["matched_stop"] = part.matched_stop
    if not stream or part.finish_reason is not None:
        choice["spec"] = part.spec
        seed = choice_seed(state, job, part.index)
        if seed is not None:
            choice["seed"] = seed
    if job.return_token_ids:
        if part.first:
            choice["prompt_token_ids"] = c.prompt_ids
        choice["token_ids"] = part.token_ids
    return choice


def choice_seed(state, job: Job, index: int) -> int | None:
    """The seed choice `index` was sampled with, under keyed sampling (`--deterministic`) only, where the seed and the
    prompt fix the tokens: the request's seed (or the one drawn for it) plus the choice's index among its prompt's n
    (engine.make_sequences). None for greedy requests and on a server without keyed sampling."""
    params = job.params[index // max(job.n, 1)]
    if not state.settings.engine.deterministic or params.greedy or params.seed is None:
        return None
    return params.seed + index % max(job.n, 1)


def whole_choice(job: Job, index: int) -> ChoicePart:
    """The finished choice `index`; with echo its text and logprobs start with the prompt's, and a prompt that was
    only scored (max_tokens 0) ends with "length" and no stop."""
    c = job.choices[index]
    text, logprobs = c.text, c.logprobs
    finish, matched = c.finish_reason, c.matched_stop
    if job.echo:
        prompt_index = index // max(job.n, 1)
        text = job.prompt_texts[prompt_index] + c.text
        logprobs = _prompt_entries(c, job.params[prompt_index].logprobs or 0) + c.logprobs
    if not job.generate:
        finish, matched = "length", None
    return ChoicePart(index, text, c.token_ids, logprobs, finish, matched, c.spec)


def full_response(state, job: Job) -> dict:
    choices = [
        choice_body(state, job, whole_choice(job, i), _splitter(state, job), stream=False)
        for i in range(len(job.choices))
    ]
    return {
        "id": job.id,
        "object": "chat.completion" if job.chat else "text_completion",
        "created": job.created,
        "model": job.model,
        "system_fingerprint": fingerprint(state),
        "choices": choices,
        "usage": job.usage(),
    }


async def sse_stream(state, job: Job, request: Request) -> AsyncIterator[bytes]:
    """The job's SSE events: (chat) a role chunk per choice, one chunk per engine event, the usage chunk when
    asked for, `[DONE]`; an engine failure is the stream's last event; nothing more once the client left."""
    head = _chunk_head(
        {
            "id": job.id,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": job.created,
            "model": job.model,
            "system_fingerprint": fingerprint(state),
        }
    )
    with_usage = job.include_usage or job.continuous_usage

    def chunk(choices: list[dict], usage: dict | None = None) -> bytes:
        rest: dict[str, Any] = {"choices": choices}
        if with_usage:
            rest["usage"] = usage if usage is not None else (job.usage() if job.continuous_usage else None)
        return _chunk(head, rest)

    started: set[int] = set()
    splitters = {i: _splitter(state, job) for i in range(len(job.choices))}
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
                yield _data(APIError(500, f"generation failed: {ev.error}", type="server_error").body())
                break
            if not ev.token_ids and ev.finish_reason is None:
                continue
            c = job.choices[ev.index]
            part = ChoicePart(
                ev.index,
                ev.text,
                ev.token_ids,
                ev.logprobs or [],
                ev.finish_reason,
                ev.matched_stop,
                ev.spec,
                text_offset=len(c.text) - len(ev.text),
                first=ev.index not in started,
            )
            started.add(ev.index)
            yield chunk([choice_body(state, job, part, splitters[ev.index], stream=True)])
    finally:
        await stream.aclose()
    if complete and job.include_usage and not job.disconnected:
        yield chunk([], job.usage())
    if not job.disconnected:
        yield b"data: [DONE]\n\n"


def _splitter(state, job: Job) -> ToolCallSplitter | None:
    """A fresh tool-call splitter for one choice of a job that may call tools, else None."""
    if job.tool_marker is None:
        return None
    return ToolCallSplitter(decode=state.tokenizer.decode, marker=job.tool_marker, parallel=job.parallel_tool_calls)


def _chunk_head(fields: dict) -> bytes:
    """`data: ` and a stream's fixed fields (id, object, created, model, system_fingerprint) as a JSON object left
    open for more: encoded once per stream rather than again in every chunk."""
    return b"data: " + json_bytes(fields)[:-1] + b","


def _chunk(head: bytes, rest: dict) -> bytes:
    """One SSE event: `head` (from _chunk_head) and the chunk's own fields; the bytes `_data` gives for the two
    dicts merged, since json_bytes writes a dict's members one after the other (`rest` is never empty)."""
    return head + json_bytes(rest)[1:] + b"\n\n"


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
        content.append(
            {
                "token": text(e["id"]),
                "logprob": e["logprob"],
                "bytes": _token_bytes(state, e["id"]),
                "top_logprobs": [
                    {"token": text(t), "logprob": lp, "bytes": _token_bytes(state, t)} for t, lp in e["top"]
                ],
            }
        )
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
    return [
        {"id": t, "logprob": None, "top": []} if e is None else {**e, "top": e["top"][:top_k]}
        for t, e in zip(c.prompt_ids, scored)
    ]


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
