"""Gate `retrieval`: exact needle answers with a normal stop at several depths, in prompts up to `--max-context`.

The needles come from the `retrieval` lane's generator (evalpipe.skills.retrieval): a key-value pair hidden in
numbered notes, asked for at the end. Every prompt fills the context (`--max-context` bytes, which are tokens for
the default byte-level model, less room for the reply); the needle sits at `--retrieval-depths` depths from just
before the question to the front of the prompt. A request passes when the reply, stripped, is exactly the code and
the server stopped by itself (finish_reason "stop").

The default model (evalpipe-skills-dsv4) fails this gate: it finds the needle at every depth (the first three digits
of its reply are right in 87% of the retrieval lane's items) but does not copy the whole code. Its failures show as
"exact answer" alone, with the transport and the stop right, which is how a weak model differs from a serving fault.
"""

from __future__ import annotations

import random
import time

from evalpipe.qualify.core import Endpoint, GateResult, check, exchange, gather_limited
from evalpipe.skills import retrieval as needles

REPLY_TOKENS = 16
FRAME = 220  # bytes of the prompt besides the filler: the needle, the question and the template


def depths(max_context: int, n: int) -> list[int]:
    """Filler bytes between the needle and the question: 0 (just before it), evenly up to the deepest that fits."""
    deepest = max(0, max_context - needles.REPLY_ROOM - FRAME - 40)
    return [round(i * deepest / (n - 1)) for i in range(n)] if n > 1 else [0]


def fixtures(max_context: int, n_depths: int, per_depth: int) -> list:
    out = []
    budget = max_context - needles.REPLY_ROOM - FRAME
    for after in depths(max_context, n_depths):
        rng = random.Random(f"qualify|retrieval|{max_context}|{after}")
        out += [
            (after, needles.generate(rng, after=after, before=max(0, budget - after), context=max_context))
            for _ in range(per_depth)
        ]
    return out


async def run(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("retrieval")
    t0 = time.perf_counter()
    if cfg.max_context < 300:
        result.problem = f"--max-context {cfg.max_context} leaves no room for a needle in notes (at least 300)"
        return result
    cases = fixtures(cfg.max_context, cfg.retrieval_depths, cfg.needles_per_depth)
    bodies = [
        ep.body(prompt=ex.prompt, max_tokens=REPLY_TOKENS, temperature=0.0, return_token_ids=True) for _, ex in cases
    ]
    outcomes = await gather_limited([ep.send(b, chat=False) for b in bodies], cfg.concurrency)
    for (after, ex), body, out in zip(cases, bodies, outcomes):
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
                expected=ex.answer,
            )
        )
    result.notes = {"max_context": cfg.max_context, "depths": sorted({r["depth"] for r in result.records})}
    result.wall_s = time.perf_counter() - t0
    return result
