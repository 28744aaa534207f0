"""Gates `boundaries` and `mixed`: a greedy continuation must not depend on what else the server is doing.

- boundaries: prompts whose lengths sit at -1, 0 and +1 of each size where a server cuts work or memory (prefill
  chunk, KV page, sliding window, each compression ratio) are first sent one by one on a cold cache (solo), then
  all at once. Each must give its solo continuation. The sizes are what the server exposes (server_sizes.py: its
  settings report, vLLM's /metrics, the launch receipt); a flag given wins.
- mixed: C short greedy decodes run (streamed; the long prompt is sent once every one of them produced output), a
  long prompt arrives in the middle of them, and every output must equal its solo run on a cold cache.

A cold cache: where the server can flush its prefix cache (/flush_cache, /reset_prefix_cache) every solo run
follows a flush, and the boundaries prompts are prefixes of one text, so that run together a prefix cache serves the
later ones from pages the earlier ones wrote. Where it cannot (stock vLLM mounts /reset_prefix_cache only in its dev
mode), every prompt starts with a tag of its own, fresh random hex, so that no earlier request can have cached any
page of it; the run together then reads the pages its own solo run wrote. Either way a solo run that reports
cached prompt tokens (usage.prompt_tokens_details.cached_tokens) fails its "cold cache" check.

Lengths are exact: with a byte-level tokenizer (the server says `tokenizer.kind: byte`) a text of L-1 bytes is L
tokens with BOS; otherwise the server's `/tokenize` gives the ids and the prompt is sent as token ids. The server's
usage.prompt_tokens is checked against the length asked for.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from typing import Any, Optional

from evalpipe.harness.client import Server
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
from evalpipe.skills import arith, copy_text
from evalpipe.skills import retrieval as needles


def boundary_sizes(ep: Endpoint) -> dict[str, list[int]]:
    """{"chunk": [512], "page": [64], "window": [64], "compression": [4, 16]}: the flags, else what the server
    exposes (server_sizes.py: its settings report, vLLM's /metrics, the launch receipt)."""
    cfg, reported = ep.cfg, ep.sizes
    sizes = {
        "chunk": [cfg.chunk_size] if cfg.chunk_size else reported.get("chunk", []),
        "page": [cfg.page_size] if cfg.page_size else reported.get("page", []),
        "window": [cfg.sliding_window] if cfg.sliding_window else reported.get("window", []),
        "compression": sorted(set(cfg.compress_ratios)) if cfg.compress_ratios else reported.get("compression", []),
    }
    return {k: v for k, v in sizes.items() if v}


def size_sources(ep: Endpoint, sizes: dict) -> dict[str, str]:
    """Where each boundary size came from: "flag", else the server_sizes source that reported it."""
    cfg = ep.cfg
    flags = {
        "chunk": cfg.chunk_size,
        "page": cfg.page_size,
        "window": cfg.sliding_window,
        "compression": cfg.compress_ratios,
    }
    return {k: "flag" if flags[k] else ep.sizes.get("sources", {}).get(k, "?") for k in sizes}


class PromptMaker:
    """Prompts of an exact token length: text on a byte-level tokenizer, else token ids from /tokenize."""

    def __init__(self, ep: Endpoint, text: str):
        self.ep = ep
        self.text = text
        tokenizer = ep.info.get("tokenizer") if isinstance(ep.info, dict) else None
        self.byte_level = isinstance(tokenizer, dict) and tokenizer.get("kind") == "byte"
        self.ids: Optional[list[int]] = None
        self.problem: Optional[str] = None
        if not self.byte_level:
            with Server(ep.base_url, ep.cfg.api_key) as server:
                body = Server.json_of(server.post("/tokenize", {"model": ep.model, "prompt": text}))
            ids = (body or {}).get("tokens") or (body or {}).get("input_ids") if isinstance(body, dict) else None
            if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
                self.ids = ids
            else:
                self.problem = (
                    "cannot build prompts of exact token lengths: the server reports no byte-level "
                    "tokenizer and has no /tokenize"
                )

    def prompt(self, length: int) -> Any:
        if self.byte_level:
            return self.text.encode()[: length - 1].decode("utf-8", errors="ignore")  # + BOS = length tokens
        return self.ids[:length]

    def longest(self) -> int:
        return len(self.text.encode()) + 1 if self.byte_level else len(self.ids or [])


def filler(n_bytes: int, seed: str) -> str:
    """ASCII notes (one byte per character) of at least n_bytes."""
    rng = random.Random(seed)
    out, i = [], 0
    while sum(len(x) + 1 for x in out) < n_bytes:
        out.append(needles.note(i, rng))
        i += 1
    return "\n".join(out)


def greedy(ep: Endpoint, prompt: Any, max_tokens: int, stream: bool = False, **extra) -> dict:
    body = ep.body(prompt=prompt, max_tokens=max_tokens, temperature=0.0, return_token_ids=True, **extra)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _length_check(out: Outcome, length: int) -> dict:
    got = (out.usage or {}).get("prompt_tokens")
    return check(
        "prompt length",
        got is None or got == length,
        f"usage.prompt_tokens {got}, asked for {length}" if got is not None else "the server reports no usage",
    )


def fresh_tag() -> str:
    """Random hex for the prompts of one gate run without a flush: no earlier request can share their first page."""
    return secrets.token_hex(8)


async def solo_runs(ep: Endpoint, bodies: list[dict], flush: bool) -> list[Outcome]:
    """Each body alone, in order; after a flush of the prefix cache first when `flush`."""
    outs = []
    for body in bodies:
        if flush:
            await ep.aflush()
        outs.append(await ep.send(body, chat=False))
    return outs


def cold_check(out: Outcome) -> list[dict]:
    """A solo run's "cold cache" check where the server reports cached prompt tokens (none where it does not)."""
    cached = cached_tokens(out)
    if cached is None:
        return []
    return [check("cold cache", cached == 0, f"usage.prompt_tokens_details.cached_tokens {cached}")]


async def run_boundaries(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("boundaries")
    t0 = time.perf_counter()
    sizes = boundary_sizes(ep)
    if not sizes:
        result.problem = (
            "no boundary sizes: the server reports none of chunk, page, window, compression ratio; "
            "give --chunk-size, --page-size, --sliding-window or --compress-ratio"
        )
        return result
    longest_wanted = max(max(v) for v in sizes.values()) + 1
    limit = cfg.max_context - cfg.max_tokens
    # bytes: a BPE token is several of them, so the text is long enough in tokens for any tokenizer
    text = filler(6 * (longest_wanted + 16), "qualify|boundaries")
    route = await ep.aflush()
    tag = None if route else fresh_tag()
    maker = await asyncio.to_thread(PromptMaker, ep, text)
    if maker.problem:
        result.problem = maker.problem
        return result
    lengths: dict[int, list[str]] = {}
    for kind, values in sizes.items():
        for size in values:
            for delta in (-1, 0, 1):
                n = size + delta
                if 2 <= n <= min(limit, maker.longest()):
                    lengths.setdefault(n, []).append(f"{kind} {size}{delta:+d}" if delta else f"{kind} {size}")
    order = sorted(lengths)
    if not order:
        result.problem = (
            f"no boundary length fits: the sizes {sizes} need prompts of 2 to {longest_wanted} tokens, and "
            f"--max-context {cfg.max_context} less --max-tokens {cfg.max_tokens} leaves {limit}"
        )
        return result
    if tag is None:
        prompts = [maker.prompt(n) for n in order]
    else:  # each length its own text, led by the length and the tag: no prompt shares a page with another
        makers = [await asyncio.to_thread(PromptMaker, ep, f"{n}:{tag}|{text}") for n in order]
        prompts = [m.prompt(n) for m, n in zip(makers, order)]
    bodies = [greedy(ep, p, cfg.max_tokens) for p in prompts]
    solos = await solo_runs(ep, bodies, flush=route is not None)
    together = await gather_limited([ep.send(b, chat=False) for b in bodies], len(bodies))
    for n, body, solo, out in zip(order, bodies, solos, together):
        for phase, o in (("solo", solo), ("together", out)):
            checks = [o.transport_check()]
            if o.ok:
                checks.append(_length_check(o, n))
                if phase == "solo":
                    checks += cold_check(o)
                if phase == "together" and solo.ok:
                    same, detail = same_output(solo, o)
                    checks.append(check("same as solo", same, detail))
            result.records.append(
                exchange(
                    f"{phase} len {n} ({', '.join(lengths[n])})",
                    f"boundaries-{phase}",
                    body,
                    o,
                    checks,
                    length=n,
                    boundaries=lengths[n],
                )
            )
    result.notes = {
        "sizes": sizes,
        "lengths": order,
        "size_sources": size_sources(ep, sizes),
        "flush_route": route,
        "cold_cache": f"flush through {route}" if route else f"a fresh tag per prompt ({tag}); no flush route",
        "prompts": "text (byte-level tokenizer)" if maker.byte_level else "token ids from /tokenize",
    }
    result.wall_s = time.perf_counter() - t0
    return result


def short_prompts(n: int) -> list[str]:
    rng = random.Random("qualify|mixed")
    return [(arith.generate(rng) if i % 2 == 0 else copy_text.generate(rng)).prompt for i in range(n)]


async def run_mixed(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("mixed")
    t0 = time.perf_counter()
    n_short = cfg.concurrency
    decode_tokens = max(2 * cfg.max_tokens, 16)  # long enough to be still decoding when the long prompt lands
    route = await ep.aflush()
    tag = None if route else fresh_tag()
    lead = (lambda i: "") if tag is None else (lambda i: f"{i}:{tag}|")  # no flush: each prompt its own first page
    shorts = [
        greedy(ep, lead(i) + p, decode_tokens, stream=True, ignore_eos=True)
        for i, p in enumerate(short_prompts(n_short))
    ]
    budget = cfg.max_context - needles.REPLY_ROOM - 220 - len(lead(n_short))
    long_ex = needles.generate(
        random.Random("qualify|mixed|long"), after=budget // 2, before=budget - budget // 2, context=cfg.max_context
    )
    long_body = greedy(ep, lead(n_short) + long_ex.prompt, 16, stream=True)
    solos = await solo_runs(ep, shorts + [long_body], flush=route is not None)
    started = [asyncio.Event() for _ in shorts]
    tasks = [
        asyncio.create_task(ep.stream(b, chat=False, hang_s=cfg.hang_s, on_first=e)) for b, e in zip(shorts, started)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), cfg.timeout_s)
    sent_at = time.time()
    long_out = await ep.stream(long_body, chat=False, hang_s=cfg.hang_s)
    short_outs = await asyncio.gather(*tasks)
    still_running = sum(o.ended_at > sent_at for o in short_outs)
    for i, (body, solo, out) in enumerate(zip(shorts + [long_body], solos, list(short_outs) + [long_out])):
        name = f"short {i}" if i < n_short else f"long ({len(long_ex.prompt)} bytes)"
        solo_checks = [solo.transport_check()] + (cold_check(solo) if solo.ok else [])
        result.records.append(exchange(f"solo {name}", "mixed-solo", body, solo, solo_checks))
        checks = [out.transport_check()]
        if out.ok and solo.ok:
            same, detail = same_output(solo, out)
            checks.append(check("same as solo", same, detail))
        if i == n_short:
            checks.append(
                check(
                    "arrived during decodes",
                    still_running > 0,
                    f"{still_running} of {n_short} short decodes were still running when it was sent",
                )
            )
        result.records.append(exchange(f"mixed {name}", "mixed", body, out, checks))
    result.notes = {
        "short_decodes": n_short,
        "decode_tokens": decode_tokens,
        "long_prompt_bytes": len(long_ex.prompt),
        "still_running_at_arrival": still_running,
        "flush_route": route,
        "cold_cache": f"flush through {route}" if route else f"a fresh tag per prompt ({tag}); no flush route",
    }
    result.wall_s = time.perf_counter() - t0
    return result
