"""Gate `kv-pressure`: greedy outputs stay the same while the server's KV pool is overfilled and its cache evicted.

The pool is `--kv-pool-tokens`, else the size the server exposes (server_sizes.py: evalpipe's `kv_pool.tokens`,
SGLang's `max_total_num_tokens`, vLLM's `vllm:cache_config_info` tokens, the launch receipt). Requests are long
needle prompts (the retrieval lane's generator: a code hidden in notes, asked for at the end), each about half the
pool or `--max-context`, whichever is smaller, each led by its own fresh random tag so that no two share a page,
completed greedily for up to REPLY_TOKENS tokens with the server's own stop:
1. serial: one at a time until their prompt and output tokens add up to at least OVERFILL x the pool, so the
   server must evict what the earlier ones left cached. Each must report no cached prompt tokens (where the server
   reports them): these outputs are the reference.
2. concurrent: the same requests again, `--concurrency` at once (live sequences past the pool: a server must
   queue, preempt or recompute, never read another sequence's pages). Each must equal its serial output token for
   token.
3. reuse: the request that finished last, once more alone. Its prefix is the most recently cached one, so the
   server must report cached prompt tokens (usage.prompt_tokens_details.cached_tokens > 0) and give the serial
   output again.
The checks compare the server with itself, so the gate means the same for a model that cannot find the needle;
whether each serial reply is the needle's code, with a normal stop, is recorded beside them (notes
`exact_answers`, `normal_stops`) and does not decide the verdict.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from typing import Optional

from evalpipe.qualify.consistency import PromptMaker, cold_check, filler, fresh_tag
from evalpipe.qualify.core import (
    Endpoint,
    GateResult,
    Outcome,
    cached_tokens,
    check,
    exchange,
    gather_limited,
    same_output,
)
from evalpipe.skills import retrieval as needles

OVERFILL = 1.2  # serial prompt + output tokens, as a multiple of the pool
REPLY_TOKENS = 16
MAX_REQUESTS = 64  # a pool that needs more requests than this is refused with the reason (too slow to fill)
MIN_PROMPT_TOKENS = 300  # room for a needle in notes


def pool_size(ep: Endpoint) -> tuple[Optional[int], str]:
    """(KV pool tokens, where the number came from); (None, "") when neither the flag nor the server gives one."""
    if ep.cfg.kv_pool_tokens:
        return ep.cfg.kv_pool_tokens, "flag --kv-pool-tokens"
    pool = ep.sizes.get("pool_tokens")
    return (pool, ep.sizes.get("sources", {}).get("pool_tokens", "server")) if pool else (None, "")


def _bytes_per_token(ep: Endpoint) -> float:
    """Bytes of needle notes per server token: 1.0 for a byte-level tokenizer or a server without /tokenize (then
    prompts come out no longer than asked), else measured on a sample through /tokenize."""
    sample = filler(4000, "qualify|kv-pressure|sample")
    maker = PromptMaker(ep, sample)
    if maker.byte_level or maker.problem or not maker.ids:
        return 1.0
    return max(1.0, len(sample.encode()) / len(maker.ids))


def _tokens(out: Outcome, fallback: int) -> int:
    usage = out.usage or {}
    total = usage.get("total_tokens")
    if isinstance(total, int) and total > 0:
        return total
    prompt, done = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt or fallback) + (done or REPLY_TOKENS)


def _brief(body: dict, index: int) -> dict:
    """A repeated request's body as recorded: the long prompt named by its serial request and its hash."""
    prompt = body["prompt"]
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:16]
    return {**body, "prompt": f"(the prompt of serial {index}, sha256 {digest})"}


def _sizing_problem(cfg, pool: Optional[int], source: str) -> tuple[int, Optional[str]]:
    """(prompt tokens per request, why the gate cannot run with this pool and --max-context, or None)."""
    if not pool:
        return 0, (
            "no KV pool size: the server reports none (evalpipe's kv_pool.tokens in /get_server_info, SGLang's "
            "max_total_num_tokens, vLLM's vllm:cache_config_info in /metrics) and no launch receipt gives one; "
            "give --kv-pool-tokens N"
        )
    per_request = min(cfg.max_context - REPLY_TOKENS - 8, pool // 2)
    if per_request < MIN_PROMPT_TOKENS:
        return per_request, (
            f"prompts of {per_request} tokens (the smaller of half the {pool}-token pool and --max-context "
            f"{cfg.max_context} less the reply) leave no room for a needle in notes: at least {MIN_PROMPT_TOKENS}"
        )
    needed = math.ceil(OVERFILL * pool / (per_request + REPLY_TOKENS))
    if needed > MAX_REQUESTS:
        return per_request, (
            f"the {pool}-token KV pool ({source}) needs about {needed} requests of {per_request} tokens "
            f"(--max-context {cfg.max_context}) to overfill {OVERFILL:g}x, more than the {MAX_REQUESTS} this gate "
            "sends: start the server with a smaller pool (vLLM --num-gpu-blocks-override, SGLang --max-total-tokens, "
            "evalpipe serve --max-batch/--max-seq-len) or qualify a longer --max-context"
        )
    return per_request, None


def _needle_request(ep: Endpoint, tag: str, context_bytes: int, i: int) -> tuple[dict, object]:
    """Request i's body (a needle prompt led by its own index and the run's tag) and its needle example."""
    lead = f"{i}:{tag}|\n"
    rng = random.Random(f"qualify|kv-pressure|{i}")
    room = context_bytes - len(lead) - needles.REPLY_ROOM - 200
    after = rng.randint(0, max(0, room))
    ex = needles.generate(rng, after=after, before=max(0, room - after), context=context_bytes - len(lead))
    body = ep.body(prompt=lead + ex.prompt, max_tokens=REPLY_TOKENS, temperature=0.0, return_token_ids=True)
    return body, ex


async def _send_serial(
    ep: Endpoint, tag: str, context_bytes: int, pool: int, per_request: int
) -> tuple[list[tuple[dict, object]], list[Outcome], int]:
    """Send requests one at a time until they overfill the pool (or one fails): (plan, outcomes, tokens filled)."""
    plan: list[tuple[dict, object]] = []
    serial: list[Outcome] = []
    filled = 0
    while filled < OVERFILL * pool and len(plan) < MAX_REQUESTS:
        body, ex = _needle_request(ep, tag, context_bytes, len(plan))
        out = await ep.send(body, chat=False)
        plan.append((body, ex))
        serial.append(out)
        filled += _tokens(out, per_request)
        if not out.ok:
            break
    return plan, serial, filled


def _record_serial(result: GateResult, plan: list[tuple[dict, object]], serial: list[Outcome]) -> None:
    for i, ((body, ex), out) in enumerate(zip(plan, serial)):
        checks = [out.transport_check()] + (cold_check(out) if out.ok else [])
        reply = out.text.strip()
        result.records.append(
            exchange(
                f"serial {i}",
                "kv-pressure-serial",
                body,
                out,
                checks,
                expected=ex.answer,
                exact_answer=out.ok and reply == ex.answer,
                prompt_tokens=(out.usage or {}).get("prompt_tokens"),
            )
        )


def _record_concurrent(
    result: GateResult, plan: list[tuple[dict, object]], serial: list[Outcome], together: list[Outcome]
) -> None:
    for i, ((body, _), solo, out) in enumerate(zip(plan, serial, together)):
        checks = [out.transport_check()]
        if out.ok:
            same, detail = same_output(solo, out)
            checks.append(check("same as serial", same, detail))
        result.records.append(exchange(f"concurrent {i}", "kv-pressure-concurrent", _brief(body, i), out, checks))


def _reuse_checks(solo: Outcome, again: Outcome) -> list:
    """The repeated request must report cached prompt tokens and give its serial output again."""
    checks = [again.transport_check()]
    if again.ok:
        cached = cached_tokens(again)
        checks.append(
            check(
                "cached prompt tokens",
                cached is not None and cached > 0,
                f"usage.prompt_tokens_details.cached_tokens {cached}"
                if cached is not None
                else "the server reports no usage.prompt_tokens_details.cached_tokens, so its prefix reuse cannot "
                "be seen (vLLM reports it with --enable-prompt-tokens-details, which `evalpipe serve --engine "
                "vllm` passes)",
            )
        )
        same, detail = same_output(solo, again)
        checks.append(check("same as serial", same, detail))
    return checks


async def run(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("kv-pressure")
    t0 = time.perf_counter()
    pool, source = pool_size(ep)
    per_request, problem = _sizing_problem(cfg, pool, source)
    if problem:
        result.problem = problem
        return result
    route = await ep.aflush()
    tag = fresh_tag()
    ratio = await asyncio.to_thread(_bytes_per_token, ep)
    context_bytes = int(per_request * ratio * 0.9)
    plan, serial, filled = await _send_serial(ep, tag, context_bytes, pool, per_request)
    _record_serial(result, plan, serial)
    if not all(o.ok for o in serial):
        result.problem = f"a serial request failed, so nothing could be compared: {result.reason}"
        result.wall_s = time.perf_counter() - t0
        return result
    if filled < OVERFILL * pool:
        result.problem = (
            f"{len(plan)} requests filled {filled} tokens, short of {OVERFILL:g}x the {pool}-token pool: the "
            "prompts came out shorter than planned"
        )
    together = await gather_limited([ep.send(body, chat=False) for body, _ in plan], cfg.concurrency)
    _record_concurrent(result, plan, serial, together)
    finished = [i for i, o in enumerate(together) if o.ok]
    last = max(finished, key=lambda i: together[i].ended_at) if finished else len(plan) - 1
    again = await ep.send(plan[last][0], chat=False)
    checks = _reuse_checks(serial[last], again)
    result.records.append(
        exchange(f"reuse of {last}", "kv-pressure-reuse", _brief(plan[last][0], last), again, checks, reused=last)
    )
    exact = sum(r.get("exact_answer") is True for r in result.records)
    stops = sum(o.finish_reason == "stop" for o in serial)
    result.notes = {
        "pool_tokens": pool,
        "pool_source": source,
        "requests": len(plan),
        "prompt_tokens_planned": per_request,
        "serial_tokens": filled,
        "overfill": round(filled / pool, 3),
        "concurrency": cfg.concurrency,
        "reused": last,
        "reuse_cached_tokens": cached_tokens(again),
        "exact_answers": f"{exact}/{len(plan)}",
        "normal_stops": f"{stops}/{len(plan)}",
        "cold_cache": f"flush through {route}, and a fresh tag per prompt ({tag})"
        if route
        else f"a fresh tag per prompt ({tag}); no flush route",
    }
    result.wall_s = time.perf_counter() - t0
    return result
