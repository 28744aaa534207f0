"""What a chat request's `tools`, `tool_choice`, `parallel_tool_calls` and `response_format` ask the engine for.

- `response_format` {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"schema": S}}:
  JSON matching S; {"type": "text"}: nothing.
- `tool_choice` "required": one call (or one or more with `parallel_tool_calls` true) of any listed tool; a named
  choice {"type": "function", "function": {"name": F}}: a call of F. Each call is the chat template's tool-call
  marker token followed by {"name": ..., "arguments": {...}} whose arguments match the tool's parameters schema.
- "auto" (the default when tools are given): the model decides, unconstrained, and a call it writes is parsed.
- "none": tools stay in the prompt (as OpenAI and vLLM do) but the marker token is masked out, so no call can start.

`parallel_tool_calls` false keeps one call; true or absent allows several (the model's own format, one marker per
call). Tools need a tokenizer with a tool-call marker (the byte tokenizer's `<|tool_call|>`); combining a response
format with tool calls that may be made is refused, since the two constraints would compete for one output.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalpipe.engine.grammar_constraint import GrammarConstraint
from evalpipe.server.errors import bad_request
from evalpipe.server.protocol import ChatCompletionRequest


@dataclass(frozen=True)
class StructuredPlan:
    grammar: GrammarConstraint | None  # what the engine masks to (None: free decoding)
    tools: list[dict] | None  # the tool definitions, as sent, for the chat template
    tool_marker: int | None  # parse calls behind this token from the output (None: no tool calls possible)
    parallel: bool  # more than one call may be returned


def plan(req: ChatCompletionRequest, tokenizer) -> StructuredPlan:
    """The constraint and parsing a request asks for; a 400 for a choice that cannot be met."""
    tools = [t.model_dump(by_alias=True, exclude_unset=True) for t in (req.tools or [])]
    choice = req.tool_choice
    named = None if choice is None or isinstance(choice, str) else choice.function.name
    mode = "named" if named is not None else (choice or ("auto" if tools else "none"))
    if mode in ("required", "named") and not tools:
        raise bad_request(
            f"tool_choice {'required' if mode == 'required' else 'naming a function'} needs tools", param="tool_choice"
        )
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools must have distinct function names", param="tools")
    if named is not None and named not in names:
        raise bad_request(
            f"tool_choice names the function {named!r}, which is not among the tools ({', '.join(names)})",
            param="tool_choice",
        )
    fmt = req.response_format
    wants_json = fmt is not None and fmt.type != "text"
    marker = getattr(tokenizer, "tool_call_token_id", None)
    calls_possible = bool(tools) and mode != "none"
    if calls_possible and marker is None:
        raise bad_request(
            "tool calling needs a chat template with a tool-call token; this server's tokenizer has "
            "none (the built-in byte tokenizer has <|tool_call|>)",
            param="tools",
        )
    if calls_possible and wants_json:
        raise bad_request(
            f"response_format {fmt.type!r} cannot be combined with tool_choice {mode!r}: send "
            'tool_choice "none" or no response_format',
            param="response_format",
        )
    parallel = req.parallel_tool_calls is not False
    grammar = None
    if wants_json:
        grammar = GrammarConstraint.json(fmt.json_schema.schema_ if fmt.type == "json_schema" else None)
    elif mode in ("required", "named"):
        chosen = [t for t in tools if mode == "required" or t["function"]["name"] == named]
        calls = [(t["function"]["name"], t["function"].get("parameters") or {"type": "object"}) for t in chosen]
        grammar = GrammarConstraint.tool_calls(marker, calls, parallel)
    elif tools and mode == "none" and marker is not None:
        grammar = GrammarConstraint.forbid([marker])
    return StructuredPlan(
        grammar=grammar, tools=tools or None, tool_marker=marker if calls_possible else None, parallel=parallel
    )
