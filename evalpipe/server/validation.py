"""From a validated OpenAI request to a `Job`: the model check, tokenization, and every limit that makes a request a
400 before the engine sees it.

One request becomes `len(prompts) * n` sequences (choice index = prompt_index * n + i); a request with more
sequences than the queue could ever hold is a 400, not a retryable 503. A chat request's tools and response_format
become a grammar on its sampling params (structured.plan).
"""

from __future__ import annotations

from typing import Any

from evalpipe.engine.sampling_params import SamplingParams, draw_seed
from evalpipe.server import structured
from evalpipe.server.errors import APIError, bad_request
from evalpipe.server.jobs import Job
from evalpipe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    check_unsupported,
)


def check_model(state, requested: str | None) -> None:
    if requested is None or requested in (state.model_id, state.settings.engine.model):
        return
    shown = requested if len(requested) <= 200 else requested[:200] + "..."
    raise APIError(
        404,
        f"The model `{shown}` does not exist (this server serves `{state.model_id}`).",
        param="model",
        code="model_not_found",
    )


def _sampling(
    state, req, max_tokens: int, logprobs: int | None, grammar=None, prompt_logprobs: int | None = None
) -> SamplingParams:
    vocab = state.vocab_size
    stop_ids = tuple(req.stop_token_ids or ())
    bad = [t for t in stop_ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"stop_token_ids must be in [0, {vocab}), got {bad[0]}", param="stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        min_p=req.min_p,
        seed=_seed(state, req),
        stop=tuple(req.stop_list()),
        stop_token_ids=stop_ids,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        grammar=grammar,
        min_tokens=req.min_output_tokens(),
        include_stop_str_in_output=req.keep_stop_text(),
        prompt_logprobs=prompt_logprobs,
    )


def _seed(state, req) -> int | None:
    """The request's seed; under keyed sampling (`--deterministic`) a sampled request without one gets a drawn seed,
    which each choice reports (responses.choice_seed), so any such output can be replayed."""
    if req.seed is None and state.settings.engine.deterministic and req.temperature > 0:
        return draw_seed()
    return req.seed


def _check_min_tokens(req, requested_max: int | None, grammar) -> None:
    """min_tokens must fit under max_tokens (vLLM's rule), and cannot hold a grammar open past its end."""
    least = req.min_output_tokens()
    if not least:
        return
    param = "min_new_tokens" if req.min_new_tokens and not req.min_tokens else "min_tokens"
    if requested_max is not None and least > requested_max:
        raise bad_request(f"{param} ({least}) must not exceed max_tokens ({requested_max})", param=param)
    if grammar is not None:
        raise bad_request(
            f"{param} cannot be combined with tools or response_format (a constrained answer ends "
            "where its grammar does)",
            param=param,
        )


def _truncate(state, ids: list[int], keep: int | None) -> list[int]:
    """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as leave room for one token)."""
    if keep is None:
        return ids
    limit = state.max_seq_len
    if keep > limit:
        raise bad_request(
            f"truncate_prompt_tokens ({keep}) exceeds the model's context of {limit} tokens",
            param="truncate_prompt_tokens",
        )
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
            param=param,
            code="context_length_exceeded",
        )
    room = limit - len(prompt)
    return room if max_tokens is None else min(max_tokens, room)


def _check_batch(state, n_sequences: int, param: str) -> None:
    """A request is queued whole or not at all: one with more sequences than the queue holds can never run."""
    limit = state.engine.info.max_queue
    if n_sequences > limit:
        raise bad_request(
            f"this request needs {n_sequences} sequences (prompts x n) but the server queues at most "
            f"{limit} (--max-queue); split it into smaller requests",
            param=param,
            code="batch_too_large",
        )


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
            raise bad_request(
                f"constrained output (tools/response_format) is not available on this server: {blocker}",
                param="response_format" if req.response_format else "tool_choice",
            )
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
        prompt = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, **kwargs
        )
    except Exception as exc:
        raise bad_request(f"chat template failed: {exc}", param="messages") from None
    prompt = _truncate(state, prompt, req.truncate_prompt_tokens)
    _check_min_tokens(req, req.max_completion_tokens or req.max_tokens, plan.grammar)
    max_tokens = _check_length(state, prompt, req.max_completion_tokens or req.max_tokens, "messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return Job(
        chat=True,
        model=state.model_id,
        prompts=[prompt],
        params=[_sampling(state, req, max_tokens, logprobs, plan.grammar)],
        n=req.n,
        stream=req.stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=req.return_token_ids,
        want_logprobs=req.logprobs,
        tool_marker=plan.tool_marker,
        parallel_tool_calls=plan.parallel,
        grammar_param="response_format" if req.response_format and req.response_format.type != "text" else "tools",
    )


def template_message(m) -> dict:
    """One message as the chat template reads it (an assistant's tool calls and a tool turn's call id included)."""
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls
        ]
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
    params = [
        _sampling(
            state, req, _check_length(state, p, max(max_tokens, 1), "prompt"), req.logprobs, prompt_logprobs=scored
        )
        for p in prompts
    ]
    return Job(
        chat=False,
        model=state.model_id,
        prompts=prompts,
        params=params,
        n=req.n,
        stream=req.stream,
        include_usage=include_usage,
        continuous_usage=continuous,
        return_token_ids=req.return_token_ids,
        want_logprobs=req.logprobs is not None,
        echo=req.echo,
        prompt_texts=texts,
        generate=generate,
        prompt_logprobs=req.prompt_logprobs,
    )
