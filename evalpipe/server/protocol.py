"""Request bodies of the OpenAI-compatible routes, validated strictly so that wrong types get a 400.

Unknown fields are accepted and ignored (clients send many optional OpenAI fields that do not change the output:
`user`, `metadata`, `priority`...). Every field that would change the output is either honoured or refused by
`check_unsupported` with a 400 that names it: penalties other than neutral, suffix, best_of != n, and the vLLM/SGLang
extensions in UNHONOURED_FIELDS (beam search among them) with a non-neutral value. Honoured extensions: `min_tokens`
(SGLang's `min_new_tokens`), `ignore_eos`, `include_stop_str_in_output` (SGLang's `no_stop_trim`),
`truncate_prompt_tokens`, and on /v1/completions `echo` (with `max_tokens` 0 or more), `prompt_logprobs` and
`add_special_tokens`. Chat requests take OpenAI's
`tools`, `tool_choice`, `parallel_tool_calls` and `response_format` (their meaning: server/structured.py); the other
constrained-output fields (legacy functions, logit_bias, vLLM/SGLang guided_* extensions) and those fields on
/v1/completions are refused by `check_structured_output`. Numbers must be finite, and no string anywhere in a body
may hold a lone UTF-16 surrogate (`"\\ud800"` is valid JSON but not text).
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
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


def refuse_surrogates(data: Any) -> Any:
    """A body validator: the body unchanged, or a validation error naming where a lone surrogate sits."""
    where = lone_surrogate_path(data)
    if where is not None:
        # the message names the place, never repeats the string (it cannot be encoded)
        raise PydanticCustomError(
            "lone_surrogate",
            "{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which "
            "is not valid Unicode text",
            {"where": where, "param": re.split(r"[.\[]", where)[0]},
        )
    return data


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM/SGLang extension: cumulative usage on every chunk


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo (the prompt scored, nothing generated)
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=64)
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's range: each value its own generator state
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    return_token_ids: bool = False
    user: str | None = None
    min_tokens: int = Field(0, ge=0)  # vLLM: no EOS, stop token or stop string before this many tokens
    min_new_tokens: int | None = Field(None, ge=0)  # SGLang's name for min_tokens
    include_stop_str_in_output: bool = False  # vLLM: keep the matched stop string in the text
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM: keep the prompt's last k tokens (-1: what fits)

    def min_output_tokens(self) -> int:
        return max(self.min_tokens, self.min_new_tokens or 0)

    def keep_stop_text(self) -> bool:
        return self.include_stop_str_in_output or self.no_stop_trim

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_surrogates(data)

    @field_validator("stop")
    @classmethod
    def _stops_are_not_empty(cls, stop: Union[str, list[str], None]) -> Union[str, list[str], None]:
        if stop is not None and "" in ([stop] if isinstance(stop, str) else stop):
            raise ValueError("a stop string must not be empty (an empty string matches everywhere)")
        return stop

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


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

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_output_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        other = info.data.get("max_tokens")
        if value is not None and other is not None and other != value:
            raise ValueError(f"max_tokens {other} and max_completion_tokens {value} disagree; send one of them")
        return value

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
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # vLLM: each prompt token's logprob + top k
    add_special_tokens: bool = True  # vLLM: text prompts get the tokenizer's BOS; token-id prompts are never changed

    def scored_prompt_top(self) -> int | None:
        """The top-k of the prompt's logprobs the response needs (vLLM's rule: echo with logprobs scores the prompt
        too), None when the prompt is not scored."""
        if self.prompt_logprobs is not None:
            return max(self.prompt_logprobs, self.logprobs or 0) if self.echo else self.prompt_logprobs
        return self.logprobs if self.echo and self.logprobs is not None else None

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
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structural_tag": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "json_schema": (None,),
}


CHAT_ONLY_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")

# vLLM / SGLang sampling extensions that change the output and that this engine does not implement, with their
# neutral values: a non-neutral value is a 400 naming the field (never silently ignored).
UNHONOURED_FIELDS: dict[str, tuple[tuple, str]] = {
    "use_beam_search": ((False, None), "beam search is not implemented"),
    "length_penalty": ((1.0, 1, None), "length_penalty only acts in beam search, which is not implemented"),
    "early_stopping": ((False, None), "early_stopping only acts in beam search, which is not implemented"),
    "allowed_token_ids": ((None,), "restricting the vocabulary is not implemented"),
    "bad_words": ((None, []), "banning words is not implemented"),
    "logprob_token_ids": ((None, []), "logprobs of chosen token ids are not implemented"),
    "skip_special_tokens": ((True, None), "special tokens are always skipped in the text (only true)"),
    "spaces_between_special_tokens": ((True, None), "only true is supported"),
    "truncation_side": ((None, "left"), 'truncate_prompt_tokens keeps the prompt\'s last tokens (only "left")'),
    "return_tokens_as_token_ids": ((False, None), "use return_token_ids instead"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported"),
    "stop_regex": ((None, []), "regular-expression stops are not implemented"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "custom_logit_processor": ((None,), "custom logits processors are not supported"),
    "continue_final_message": ((False, None), "continuing the last message is not implemented"),
    "chat_template": ((None,), "a request-level chat template is not accepted; the model's own is used"),
    "return_hidden_states": ((False, None), "hidden states are not returned"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "documents": ((None, []), "documents for the chat template are not supported"),
    "vllm_xargs": ((None, {}), "custom sampling arguments are not supported"),
}
# fields that only /v1/completions honours: on chat they are refused when non-neutral
COMPLETION_ONLY_FIELDS: dict[str, tuple] = {
    "echo": (False, None),
    "prompt_logprobs": (None,),
    "suffix": (None, ""),
    "add_special_tokens": (False, None),
}


def check_structured_output(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first tool-calling or constrained-output field with a non-neutral value."""
    extra = req.model_extra or {}
    for name, neutral in STRUCTURED_OUTPUT_FIELDS.items():
        if name in extra and not any(extra[name] == v and type(extra[name]) is type(v) for v in neutral):
            if name in CHAT_ONLY_FIELDS:
                return name, f"{name} is only supported on /v1/chat/completions (tool calls and response formats)"
            what = (
                "logit biasing"
                if name == "logit_bias"
                else ("tool calling" if "tool" in name or "function" in name else "constrained output")
            )
            return name, (
                f"{name} is not supported by this engine ({what} is not implemented); "
                "remove the field or send a neutral value"
            )
    return None


def _is_neutral(value: Any, neutral: tuple) -> bool:
    return any(value == v and type(value) is type(v) for v in neutral)


def check_unhonoured(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first extension field that would change the output and is not implemented."""
    extra = req.model_extra or {}
    for name, (neutral, why) in UNHONOURED_FIELDS.items():
        if name in extra and not _is_neutral(extra[name], neutral):
            return name, f"{name} is not supported by this engine ({why}); remove the field or send a neutral value"
    if isinstance(req, ChatCompletionRequest):
        for name, neutral in COMPLETION_ONLY_FIELDS.items():
            if name in extra and not _is_neutral(extra[name], neutral):
                return name, f"{name} is only supported on /v1/completions"
    return None


def check_unsupported(req: _Sampling) -> tuple[str, str] | None:
    """(param, message) for the first field this engine cannot honour or combination it refuses, else None."""
    structured = check_structured_output(req) or check_unhonoured(req)
    if structured:
        return structured
    if req.min_tokens and req.min_new_tokens is not None and req.min_new_tokens != req.min_tokens:
        return "min_new_tokens", "min_tokens and min_new_tokens (its SGLang name) differ; send one of them"
    if req.truncate_prompt_tokens == 0:
        return "truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (what fits) or at least 1"
    echo = isinstance(req, CompletionRequest) and req.echo
    if req.max_tokens == 0 and not echo:
        return "max_tokens", "max_tokens must be at least 1 (0 is only allowed with echo: true)"
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
        if req.stream and req.echo:
            return "echo", "echo is not supported with stream: true (send a non-streamed request)"
        if req.stream and req.prompt_logprobs is not None:
            return "prompt_logprobs", "prompt_logprobs is not available with stream: true (as in vLLM)"
        if req.suffix:
            return "suffix", "suffix is not supported by this engine"
        if req.best_of is not None and req.best_of != req.n:
            return "best_of", "best_of is not supported by this engine (only best_of == n)"
    return None


class TokenizeRequest(BaseModel):
    """/tokenize, vLLM's two forms and SGLang's: `prompt` (a string, or SGLang's list of strings) or `messages` (a
    chat, rendered by the model's template). `add_special_tokens` defaults as in vLLM: true for a prompt (its BOS),
    false for messages (the template writes its own)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    prompt: Union[str, list[str], None] = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return refuse_surrogates(data)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) and messages (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    """/detokenize: vLLM's `tokens` (one list; answer `prompt`) or SGLang's list of lists (answer `text`, a list)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    tokens: Union[list[int], list[list[int]]]
    skip_special_tokens: bool = True
