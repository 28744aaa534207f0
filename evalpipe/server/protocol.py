"""Request bodies of the OpenAI-compatible routes, validated strictly so that wrong types get a 400.

Unknown fields are accepted and ignored (clients send many optional OpenAI fields). Fields this engine cannot
honour (repetition/frequency/presence penalties other than neutral, echo, suffix, best_of != n) are refused
by `check_unsupported` with a 400 that names the field, rather than silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM/SGLang extension: cumulative usage on every chunk


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    return_token_ids: bool = False
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        """The message content as one string; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        out = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content part type {part.type!r} is not supported (text only)")
            out.append(part.text)
        return "".join(out)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: bool = True


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one string, one token-id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def check_unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first field this engine cannot honour or combination it refuses, else None."""
    if req.stream_options is not None and not req.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        return "top_logprobs", "top_logprobs requires logprobs to be true"
    if req.repetition_penalty is not None and req.repetition_penalty != 1.0:
        return "repetition_penalty", "repetition_penalty is not supported by this engine (only 1.0)"
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        if value is not None and value != 0.0:
            return name, f"{name} is not supported by this engine (only 0)"
    if isinstance(req, CompletionRequest):
        if req.echo:
            return "echo", "echo is not supported by this engine"
        if req.suffix:
            return "suffix", "suffix is not supported by this engine"
        if req.best_of is not None and req.best_of != req.n:
            return "best_of", "best_of is not supported by this engine (only best_of == n)"
    return None
