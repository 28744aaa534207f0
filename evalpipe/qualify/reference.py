"""Gate `reference`: greedy agreement with a reference recorded on an earlier boot.

`--record-reference ref.json` sends 20 fixed fixtures (skill prompts: arithmetic, copy, short retrieval) greedily,
up to 48 tokens with logprobs, and stores for each the exact body, the first token and the continuation (token
ids, text, logprobs), with the server's receipt (model list and its settings report). `--reference ref.json`
replays the stored bodies (with the served model's id) and reports per fixture whether the first token and the
whole continuation agree, the first divergence position, and the logprob gap there (the new run's logprob of its
own token minus its logprob of the reference token, when that is among its top logprobs: how close the call was).
The gate passes on 20/20 first tokens and 20/20 continuations.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any, Optional

from evalpipe import __version__
from evalpipe.qualify.core import Endpoint, GateResult, Outcome, check, exchange, first_divergence, gather_limited
from evalpipe.skills import arith, copy_text
from evalpipe.skills import retrieval as needles

N_FIXTURES = 20
CONTINUATION_TOKENS = 48
SCHEMA = "evalpipe-qualify-reference/1"


class ReferenceError(Exception):
    """The reference file is missing, unreadable or not a reference."""


def fixture_prompts() -> list[tuple[str, str]]:
    rng = random.Random("qualify|reference|v1")
    out = []
    for i in range(N_FIXTURES):
        if i % 3 == 0:
            ex = arith.generate(rng)
        elif i % 3 == 1:
            ex = copy_text.generate(rng)
        else:
            ex = needles.generate(rng, after=rng.randint(0, 40), before=rng.randint(0, 200))
        out.append((f"{ex.skill}-{i:02d}", ex.prompt))
    return out


def body_for(ep: Endpoint, prompt: str) -> dict:
    return ep.body(prompt=prompt, max_tokens=CONTINUATION_TOKENS, temperature=0.0, logprobs=2, return_token_ids=True)


def entry(fid: str, body: dict, out: Outcome) -> dict:
    tokens = out.tokens or []
    first = {
        "id": (out.token_ids or [None])[0],
        "text": tokens[0] if tokens else out.text[:1],
        "logprob": (out.logprobs or [None])[0],
    }
    return {
        "id": fid,
        "body": body,
        "first_token": first,
        "token_ids": out.token_ids,
        "text": out.text,
        "tokens": out.tokens,
        "logprobs": out.logprobs,
        "finish_reason": out.finish_reason,
    }


def load(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReferenceError(f"{path}: no such reference file (record one with --record-reference)") from None
    except (OSError, ValueError) as exc:
        raise ReferenceError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("fixtures"), list):
        raise ReferenceError(f"{path}: not a qualify reference (schema {SCHEMA!r} with a fixtures list)")
    for i, fixture in enumerate(data["fixtures"]):
        problem = fixture_problem(fixture)
        if problem:
            raise ReferenceError(f"{path}: fixture {i} {problem} (record the file again with --record-reference)")
    return data


def fixture_problem(fixture: Any) -> Optional[str]:
    """What makes one stored fixture unusable by `compare`, or None."""
    if not isinstance(fixture, dict):
        return f"is a {type(fixture).__name__}, not an object"
    if not isinstance(fixture.get("body"), dict):
        return "has no request body object"
    if not isinstance(fixture.get("first_token"), dict):
        return "has no first_token object"
    if not isinstance(fixture.get("text"), str):
        return "has no text"
    for key in ("token_ids", "tokens", "logprobs"):
        if fixture.get(key) is not None and not isinstance(fixture[key], list):
            return f"has a {key} that is not a list"
    return None


def compare_one(ref: dict, out: Outcome) -> dict:
    """Agreement of one fixture's new output with its reference entry."""
    use_ids = ref.get("token_ids") is not None and out.token_ids is not None
    a = ref["token_ids"] if use_ids else (ref.get("tokens") or list(ref.get("text") or ""))
    b = out.token_ids if use_ids else (out.tokens or list(out.text))
    pos = first_divergence(a, b)
    same = pos is None and ref.get("text") == out.text
    gap = None
    new_lp = ref_lp = None
    if pos is not None:
        if out.logprobs and pos < len(out.logprobs):
            new_lp = out.logprobs[pos]
        if ref.get("logprobs") and pos < len(ref["logprobs"]):
            ref_lp = ref["logprobs"][pos]
        tops = out.top_logprobs or []
        ref_tokens = ref.get("tokens") or []
        if pos < len(tops) and pos < len(ref_tokens) and isinstance(tops[pos], dict) and new_lp is not None:
            lp_of_ref = tops[pos].get(ref_tokens[pos])
            gap = None if lp_of_ref is None else new_lp - lp_of_ref
    return {
        "first_token_agrees": pos is None or pos > 0,
        "continuation_agrees": same,
        "first_divergence": pos,
        "compared": "token ids" if use_ids else "token texts",
        "reference_logprob": ref_lp,
        "new_logprob": new_lp,
        "logprob_gap": gap,
    }


async def record(ep: Endpoint, path: Path) -> GateResult:
    result = GateResult("reference")
    t0 = time.perf_counter()
    prompts = fixture_prompts()
    bodies = [body_for(ep, p) for _, p in prompts]
    outs = await gather_limited([ep.send(b, chat=False) for b in bodies], ep.cfg.concurrency)
    entries = []
    for (fid, _), body, out in zip(prompts, bodies, outs):
        checks = [out.transport_check()]
        if out.ok:
            checks.append(check("continuation", bool(out.text), f"{len(out.token_ids or out.text)} tokens"))
            entries.append(entry(fid, body, out))
        result.records.append(exchange(f"record {fid}", "reference-record", body, out, checks))
    if result.failed == 0:
        ref = {
            "schema": SCHEMA,
            "created_at": time.time(),
            "evalpipe_version": __version__,
            "model": ep.model,
            "receipt": ep.facts,
            "fixtures": entries,
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(ref, indent=1, ensure_ascii=False, default=str) + "\n")
        result.notes = {"recorded": str(path), "fixtures": len(entries)}
    else:
        result.problem = f"not every fixture answered; {path} was not written"
    result.wall_s = time.perf_counter() - t0
    return result


async def compare(ep: Endpoint, ref: dict, path: Path) -> GateResult:
    result = GateResult("reference")
    t0 = time.perf_counter()
    fixtures = ref["fixtures"]
    bodies = [dict(f["body"], model=ep.model) for f in fixtures]
    outs = await gather_limited([ep.send(b, chat=False) for b in bodies], ep.cfg.concurrency)
    n_first = n_cont = 0
    for f, body, out in zip(fixtures, bodies, outs):
        checks = [out.transport_check()]
        agreement: Optional[dict[str, Any]] = None
        if out.ok:
            agreement = compare_one(f, out)
            n_first += agreement["first_token_agrees"]
            n_cont += agreement["continuation_agrees"]
            where = agreement["first_divergence"]
            checks.append(
                check(
                    "first token agrees",
                    agreement["first_token_agrees"],
                    f"reference {f['first_token']['text']!r}, now {(out.tokens or [out.text[:1]])[0]!r}",
                )
            )
            checks.append(
                check(
                    "continuation agrees",
                    agreement["continuation_agrees"],
                    "identical"
                    if where is None
                    else f"diverges at token {where} (logprob gap {agreement['logprob_gap']})",
                )
            )
        result.records.append(
            exchange(f"compare {f['id']}", "reference-compare", body, out, checks, agreement=agreement)
        )
    result.notes = {
        "reference": str(path),
        "reference_model": ref.get("model"),
        "model": ep.model,
        "first_token_agreement": f"{n_first}/{len(fixtures)}",
        "continuation_agreement": f"{n_cont}/{len(fixtures)}",
        "reference_server": (ref.get("receipt") or {}).get("server_info_path"),
    }
    if len(fixtures) < N_FIXTURES:
        result.problem = f"{path} holds {len(fixtures)} fixtures, not {N_FIXTURES}"
    result.wall_s = time.perf_counter() - t0
    return result
