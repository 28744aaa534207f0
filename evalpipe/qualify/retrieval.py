"""Gate `retrieval`: exact needle answers with a normal stop at several depths, in prompts that fill `--max-context`.

The needles come from the `retrieval` lane's generator (evalpipe.skills.retrieval): a key-value pair hidden in
numbered notes, asked for at the end. A request passes when the reply, stripped, is exactly the code and the server
stopped by itself (finish_reason "stop").

Two prompt forms (`--prompt-form`):
- completions: `Question: <notes and question>\\nAnswer:` on /v1/completions, the default model's trained format;
- chat: the notes, the question and `Reply with the code only.` (the `chat-retrieval` lane's user message) on
  /v1/chat/completions, through the model's own chat template.
`auto` takes the completion form for a byte-level tokenizer (the server info says `tokenizer.kind` "byte": evalpipe's
own models, trained on that form at every depth), else the chat form when the server renders a chat through
POST /tokenize (the model has a chat template), else the completion form.

The fill is counted in the server's tokens: each prompt, as sent (a chat rendered by the template), is measured with
POST /tokenize, and the filler is scaled until the longest prompt is at most `--max-context` less REPLY_ROOM tokens
and within FIT_SLACK of it. A server without /tokenize is filled by bytes (bytes are tokens for the byte-level model;
a subword model's prompts then fill a fraction of its context), and the gate's notes say so.

The default model passes this gate. The window-64 model (evalpipe-skills-dsv4-w64) fails it: it finds the needle
at every depth (the first three digits of its reply are right in 87% of the retrieval lane's items) but does not
copy the whole code. Its failures show as "exact answer" alone, with the transport and the stop right, which is
how a weak model differs from a serving fault.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Callable, Optional

from evalpipe.harness.client import Server
from evalpipe.lanes.chat_retrieval import TEMPLATE as CHAT_TEMPLATE
from evalpipe.qualify.core import Endpoint, GateResult, check, exchange, gather_limited
from evalpipe.skills import retrieval as needles

REPLY_TOKENS = 16
FRAME = 220  # bytes of the prompt besides the filler: the needle, the question and the template
PROMPT_FORMS = ("auto", "chat", "completions")
FIT_ROUNDS = 8  # rescalings of the filler before the fill settles (two or three do on real tokenizers)
FIT_SLACK = 0.03  # the longest prompt may fall short of the token budget by this fraction


def depths(max_context: int, n: int) -> list[int]:
    """Filler bytes between the needle and the question: 0 (just before it), evenly up to the deepest that fits."""
    deepest = max(0, max_context - needles.REPLY_ROOM - FRAME - 40)
    return [round(i * deepest / (n - 1)) for i in range(n)] if n > 1 else [0]


def fixtures(max_context: int, n_depths: int, per_depth: int) -> list:
    """(filler bytes after the needle, example) for prompts of about `max_context` bytes."""
    out = []
    budget = max_context - needles.REPLY_ROOM - FRAME
    for after in depths(max_context, n_depths):
        rng = random.Random(f"qualify|retrieval|{max_context}|{after}")
        out += [
            (after, needles.generate(rng, after=after, before=max(0, budget - after), context=max_context))
            for _ in range(per_depth)
        ]
    return out


def chat_messages(ex) -> list:
    return [{"role": "user", "content": CHAT_TEMPLATE.format(body=ex.body)}]


def fit_in_tokens(
    count: Callable[[object], Optional[int]], max_context: int, n_depths: int, per_depth: int
) -> Optional[tuple[list, list[int]]]:
    """(cases, their prompts' token counts) whose longest prompt is at most max_context - REPLY_ROOM tokens and,
    where the filler allows, within FIT_SLACK of it; None when the server cannot count a prompt."""
    target = max_context - needles.REPLY_ROOM
    size, best = max_context, None
    for _ in range(FIT_ROUNDS):
        cases = fixtures(size, n_depths, per_depth)
        counts = [count(ex) for _, ex in cases]
        if any(c is None for c in counts):
            return None
        longest = max(counts)
        if longest <= target and (best is None or longest > max(best[1])):
            best = (cases, counts)
        if longest <= target and longest >= target * (1 - FIT_SLACK):
            break
        size = max(300, int(size * target / longest) - (1 if longest > target else 0))
    return best


async def run(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("retrieval")
    t0 = time.perf_counter()
    if cfg.max_context < 300:
        result.problem = f"--max-context {cfg.max_context} leaves no room for a needle in notes (at least 300)"
        return result
    form, why = await asyncio.to_thread(prompt_form, ep)
    chat = form == "chat"

    def fit() -> Optional[tuple[list, list[int]]]:
        with Server(ep.base_url, cfg.api_key) as server:

            def count(ex) -> Optional[int]:
                if chat:
                    return server.count_tokens(ep.model, messages=chat_messages(ex))
                return server.count_tokens(ep.model, prompt=ex.prompt)

            return fit_in_tokens(count, cfg.max_context, cfg.retrieval_depths, cfg.needles_per_depth)

    fitted = await asyncio.to_thread(fit)
    if fitted is None:
        cases = fixtures(cfg.max_context, cfg.retrieval_depths, cfg.needles_per_depth)
        counts: list = [None] * len(cases)
        fill = "bytes: the server has no /tokenize for this prompt form, so a subword model's prompts fill less"
    else:
        cases, counts = fitted
        fill = "tokens: every prompt as sent, counted by the server's POST /tokenize"
    bodies = [
        ep.body(messages=chat_messages(ex), max_tokens=REPLY_TOKENS, temperature=0.0, return_token_ids=True)
        if chat
        else ep.body(prompt=ex.prompt, max_tokens=REPLY_TOKENS, temperature=0.0, return_token_ids=True)
        for _, ex in cases
    ]
    outcomes = await gather_limited([ep.send(b, chat=chat) for b in bodies], cfg.concurrency)
    for (after, ex), body, out, n_tokens in zip(cases, bodies, outcomes, counts):
        checks = [out.transport_check()]
        if out.ok:
            reply = out.text.strip()
            checks.append(check("exact answer", reply == ex.answer, f"replied {reply!r}, expected {ex.answer!r}"))
            checks.append(check("normal stop", out.finish_reason == "stop", f"finish_reason {out.finish_reason}"))
        result.records.append(
            exchange(
                f"depth {ex.meta['depth']} {ex.meta['key']}",
                "retrieval",
                body,
                out,
                checks,
                depth=ex.meta["depth"],
                prompt_bytes=len(ex.prompt.encode()),
                prompt_tokens=n_tokens,
                expected=ex.answer,
            )
        )
    result.notes = {
        "max_context": cfg.max_context,
        "prompt_form": form,
        "prompt_form_reason": why,
        "fill": fill,
        "longest_prompt_tokens": max(counts) if fitted is not None else None,
        "depths": sorted({r["depth"] for r in result.records}),
    }
    result.wall_s = time.perf_counter() - t0
    return result


def prompt_form(ep: Endpoint) -> tuple[str, str]:
    """(form, why) for `--prompt-form` (module docstring)."""
    chosen = ep.cfg.retrieval_prompt_form
    if chosen != "auto":
        return chosen, f"--prompt-form {chosen}"
    tokenizer = ep.info.get("tokenizer") if isinstance(ep.info, dict) else None
    if isinstance(tokenizer, dict) and tokenizer.get("kind") == "byte":
        return "completions", "auto: a byte-level tokenizer (evalpipe's own models, trained on the completion form)"
    with Server(ep.base_url, ep.cfg.api_key) as server:
        rendered = server.count_tokens(ep.model, messages=[{"role": "user", "content": "Reply with OK only."}])
    if rendered is not None:
        return "chat", "auto: the server renders the model's chat template (POST /tokenize with messages)"
    return "completions", "auto: the server renders no chat through POST /tokenize"
