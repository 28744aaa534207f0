"""Request bodies of the OpenAI-compatible routes, validated strictly so that wrong types get a 400.

Unknown fields are accepted and ignored (clients send many optional OpenAI fields). Fields this engine cannot
honour (repetition/frequency/presence penalties other than neutral, echo, suffix, best_of != n) are refused
by `check_unsupported` with a 400 that names the field, rather than silently ignored. Chat requests take OpenAI's
`tools`, `tool_choice`, `parallel_tool_calls` and `response_format` (their meaning: server/structured.py); the other
constrained-output fields (legacy functions, logit_bias, vLLM/SGLang guided_* extensions) and those fields on
/v1/completions are refused by `check_structured_output`. Numbers must be finite, and no string anywhere in a body
may hold a lone UTF-16 surrogate (`"\\ud800"` is valid JSON but not text).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20
# Finite and bounded: far beyond the range that changes sampling (OpenAI allows 0-2), and an fp32 logit row
# divided by 1e39 or more is inf/nan, not a distribution.
MAX_TEMPERATURE = 100.0
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_path(value: Any) -> str | None:
    """Where the first string (or object key) holding a lone UTF-16 surrogate sits, as `messages[0].content`;
    None when every string is valid Unicode. Iterative, so any nesting depth the JSON parser accepted is fine."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    return f"{path}.<key>" if path else "<key>"
                stack.append((f"{path}.{key}" if path else str(key), sub))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", sub) for i, sub in enumerate(item))
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM/SGLang extension: cumulative usage on every chunk


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
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

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_path(data)
        if where is not None:
            # the message names the place, never repeats the string (it cannot be encoded)
            raise PydanticCustomError(
                "lone_surrogate", "{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which "
                "is not valid Unicode text", {"where": where, "param": re.split(r"[.\[]", where)[0]})
        return data

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


# OpenAI's rule for function names (the name a tool call carries back)
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(..., pattern=FUNCTION_NAME)
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(..., pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments ({})
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(..., pattern=FUNCTION_NAME)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(..., min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a "json_schema" object ({"name": ..., "schema": {...}})')
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls (rendered back by the chat template)
    tool_call_id: str | None = None  # a tool turn's answer to which call

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
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None


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


# Constrained-output fields this server does not take (on chat, `tools`, `tool_choice`, `parallel_tool_calls` and
# `response_format` are declared fields of ChatCompletionRequest, so they never reach this check there): a request
# that asks for them gets a 400 instead of unconstrained text. Values listed here are neutral (ask for nothing).
STRUCTURED_OUTPUT_FIELDS: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}),
    # vLLM / SGLang constrained-decoding extensions
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structural_tag": (None,), "regex": (None,), "ebnf": (None,), "json_schema": (None,),
}


CHAT_ONLY_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")


def check_structured_output(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first tool-calling or constrained-output field with a non-neutral value."""
    extra = req.model_extra or {}
    for name, neutral in STRUCTURED_OUTPUT_FIELDS.items():
        if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in neutral):
            if name in CHAT_ONLY_FIELDS:
                return name, f"{name} is only supported on /v1/chat/completions (tool calls and response formats)"
            what = "logit biasing" if name == "logit_bias" else (
                "tool calling" if "tool" in name or "function" in name else "constrained output")
            return name, (f"{name} is not supported by this engine ({what} is not implemented); "
                          "remove the field or send a neutral value")
    return None


def check_unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first field this engine cannot honour or combination it refuses, else None."""
    structured = check_structured_output(req)
    if structured:
        return structured
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
