"""Gate `structured`: tool calls and JSON-schema output, streamed and not, one at a time and C at once.

Cases (the chat skill's fixtures, evalpipe.skills.chat, so the default model was taught exactly these):
- tool_choice auto, required and named: the reply is one call of the expected tool with the expected arguments
  (parsed JSON, compared as objects), finish_reason "tool_calls" ("stop" too for a named call, as OpenAI ends a
  forced call), and no text beside it;
- tool-result continuation: after the call and the tool's answer, the reply states the value and stops normally;
- response_format json_schema: the content parses to the expected object and the reply stops normally.
Every reply is also checked for leaked or repeated tool protocol: no template marker (`<|tool_call|>` and the like)
in any content or arguments, and exactly one call where one is expected. Each case is sent plain and streamed,
serially, then all of them again with C in flight.

When tool_choice auto gave no call in any answered request, the gate's reason says which of two things happened
(`no_call_diagnosis`): the replies hold a call in text that the server did not parse (its tool-call parser does not
fit the model), or they are plain text (the model does not call tools).

Drawn tools (evalpipe.skills.tools, held-out split: tool names, parameters and argument values drawn per case,
arguments copied from the ask) are sent beside them and checked the same way, exact arguments included. Until a
default model
trained on them ships, their result is reported in the gate's notes (`drawn_tools`: exact calls of
those sent, the first miss), not counted in its verdict: DRAWN_TOOLS_ENFORCED turns them into ordinary cases.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from evalpipe.qualify.core import Endpoint, GateResult, Outcome, check, exchange, gather_limited, leaked_protocol
from evalpipe.skills import chat, draw, tools

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "fact", "schema": chat.JSON_SCHEMA, "strict": True}}
MAX_TOKENS = 128  # a call with its JSON arguments is about 80 byte-level tokens
# The tool whose arguments the trained models reproduce every time (the window-64 model garbles get_secret_code's
# place names), so that a wrong argument here points at the server, not the model; the gate still sends both tools in
# every request.
RELIABLE_TOOL = "count_items"
DRAWN_TOOLS_ENFORCED = False


def _call_of(ex: chat.ChatExample) -> dict:
    return json.loads(ex.reply[len("<|tool_call|>") :])


def cases(seed: str) -> list[dict]:
    """[{"name", "body" (without model/stream), "expect"}] for one round of the five kinds."""
    rng = random.Random(seed)
    out = []
    for choice in ("auto", "required", "named"):
        ex = chat.tool_call(rng)
        while _call_of(ex)["name"] != RELIABLE_TOOL:
            ex = chat.tool_call(rng)
        call = _call_of(ex)
        tool_choice: Any = choice if choice != "named" else {"type": "function", "function": {"name": call["name"]}}
        out.append(
            {
                "name": f"tool_choice {choice}",
                "body": {"messages": ex.messages, "tools": ex.tools, "tool_choice": tool_choice},
                # a call the request named is a forced reply: OpenAI ends it with "stop" (vLLM does too)
                "expect": {"call": call, **({"finish": ["tool_calls", "stop"]} if choice == "named" else {})},
            }
        )
    ex = chat.tool_result(rng)
    out.append(
        {
            "name": "tool result",
            "body": {"messages": ex.messages, "tools": ex.tools, "tool_choice": "auto"},
            "expect": {"value": ex.meta["expected"]},
        }
    )
    ex = chat.json_reply(rng)
    out.append(
        {
            "name": "json_schema",
            "body": {"messages": ex.messages, "response_format": SCHEMA_FORMAT},
            "expect": {"json": ex.meta["expected"]},
        }
    )
    ex = draw(tools.generate, rng, "heldout")
    out.append(
        {
            "name": "drawn tool",
            "body": {"messages": ex.messages, "tools": ex.tools, "tool_choice": "auto"},
            "expect": {"call": ex.meta["expected"]},
            "advisory": not DRAWN_TOOLS_ENFORCED,
        }
    )
    return out


def _arguments(raw: Any) -> Any:
    if isinstance(raw, dict):
        return raw
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return None


def checks_for(expect: dict, out: Outcome) -> list[dict]:
    checks = [out.transport_check()]
    if not out.ok:
        return checks
    calls = out.tool_calls or []
    texts = [out.text] + [str(c.get("arguments")) for c in calls] + [str(c.get("name")) for c in calls]
    leaked = leaked_protocol(*texts)
    checks.append(check("no leaked tool protocol", not leaked, f"found {leaked}" if leaked else "none"))
    if "call" in expect:
        want = expect["call"]
        checks.append(check("one tool call", len(calls) == 1, f"{len(calls)} calls"))
        if calls:
            got = calls[0]
            checks.append(
                check("tool name", got.get("name") == want["name"], f"{got.get('name')!r}, expected {want['name']!r}")
            )
            args = _arguments(got.get("arguments"))
            checks.append(
                check(
                    "arguments",
                    args == want["arguments"],
                    f"{got.get('arguments')!r}, expected {json.dumps(want['arguments'])}",
                )
            )
        finishes = expect.get("finish", ["tool_calls"])
        checks.append(
            check(
                "finish tool_calls",
                out.finish_reason in finishes,
                f"finish_reason {out.finish_reason}" + ("" if len(finishes) == 1 else f" (one of {finishes})"),
            )
        )
        checks.append(check("no text beside the call", not out.text.strip(), repr(out.text[:80])))
    else:
        checks.append(check("no tool call", not calls, f"{len(calls)} calls"))
        checks.append(check("normal stop", out.finish_reason == "stop", f"finish_reason {out.finish_reason}"))
        if "value" in expect:
            checks.append(
                check(
                    "states the result",
                    expect["value"] in out.text,
                    f"replied {out.text[:80]!r}, expected it to hold {expect['value']!r}",
                )
            )
        else:
            try:
                parsed = json.loads(out.text)
            except ValueError:
                parsed = None
            checks.append(
                check(
                    "schema JSON",
                    parsed == expect["json"],
                    f"replied {out.text[:120]!r}, expected {json.dumps(expect['json'])}",
                )
            )
    return checks


def no_call_diagnosis(records: list[dict]) -> str | None:
    """Why tool_choice "auto" never gave a call, when it never did in any answered request: the replies hold a call
    the server did not parse (its parser does not fit the model), or plain text (the model does not call tools)."""
    auto = [
        r
        for r in records
        if "call" in r["expect"] and r["body"].get("tool_choice") == "auto" and r.get("ok") and r.get("output")
    ]
    if not auto or any(r["output"].get("tool_calls") for r in auto):
        return None
    texts = [r["output"].get("text") or "" for r in auto]
    unparsed = [
        t for t in texts if leaked_protocol(t) or ('"name"' in t and ('"arguments"' in t or '"parameters"' in t))
    ]
    if unparsed:
        return (
            f"tool_choice auto gave no parsed call in any of {len(auto)} requests, yet replies hold one (e.g. "
            f"{unparsed[0][:200]!r}): the server's tool-call parser does not read this model's format (vLLM: "
            "`evalpipe serve --engine vllm --tool-call-parser NAME`); first failed check: "
            + next(f"{r['id']}: {c['name']}: {c['detail']}" for r in auto for c in r["checks"] if not c["ok"])
        )
    return (
        f"the model does not call tools: with tool_choice auto it answered all {len(auto)} requests with text and "
        f"no call (e.g. {texts[0][:200]!r}), each with HTTP 200: a model whose chat template does not render tools, "
        "or that was not trained to call them, replies this way"
    )


def drawn_tools_note(records: list[dict]) -> dict:
    """What the drawn-tool cases showed when they are not enforced: exact calls of those sent, and the first miss."""
    miss = next((f"{r['id']}: {c['name']}: {c['detail']}" for r in records for c in r["checks"] if not c["ok"]), None)
    return {
        "enforced": DRAWN_TOOLS_ENFORCED,
        "exact": sum(r["verdict"] == "pass" for r in records),
        "sent": len(records),
        "first_miss": miss,
    }


async def run(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("structured")
    t0 = time.perf_counter()
    plan = []
    for case in cases("qualify|structured|serial"):
        for stream in (False, True):
            plan.append(("serial", case, stream))
    kinds = len(cases("qualify|structured|serial"))
    rounds = max(1, -(-cfg.concurrency // kinds))
    parallel = [c for r in range(rounds) for c in cases(f"qualify|structured|c|{r}")][: max(cfg.concurrency, kinds)]
    for i, case in enumerate(parallel):
        plan.append((f"C{cfg.concurrency}", case, i % 2 == 1))

    def body_of(case: dict, stream: bool) -> dict:
        body = ep.body(**case["body"], max_tokens=MAX_TOKENS, temperature=0.0)
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body

    serial = [(m, c, s) for m, c, s in plan if m == "serial"]
    outcomes = [await ep.send(body_of(c, s), chat=True) for _, c, s in serial]
    together = [(m, c, s) for m, c, s in plan if m != "serial"]
    outcomes += await gather_limited([ep.send(body_of(c, s), chat=True) for _, c, s in together], cfg.concurrency)
    advisory = []
    for (mode, case, stream), out in zip(serial + together, outcomes):
        record = exchange(
            f"{mode} {case['name']} {'streamed' if stream else 'plain'}",
            "structured",
            body_of(case, stream),
            out,
            checks_for(case["expect"], out),
            expect=case["expect"],
            mode=mode,
            stream=stream,
        )
        (advisory if case.get("advisory") else result.records).append(record)
    refused = [r for r in result.records if r.get("status") == 400]
    if refused and len(refused) == len(result.records):
        result.problem = "the server refuses tool calling / response_format (HTTP 400 on every request): " + str(
            refused[0].get("error")
        )
    else:
        result.problem = no_call_diagnosis(result.records)
    result.notes = {
        "cases": len(result.records),
        "concurrency": cfg.concurrency,
        "drawn_tools": drawn_tools_note(advisory),
    }
    result.wall_s = time.perf_counter() - t0
    return result
