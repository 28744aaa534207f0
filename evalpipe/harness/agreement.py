"""Output agreement between two responses to the same prompt: identical or not, and where they fork.

Speculative decoding is lossless only in exact arithmetic, so the first diagnostic at temperature 0
is the share of token-identical outputs and, for the rest, the first position where they differ.
Token ids are compared when both records carry `output_token_ids`; else the token strings of
recorded logprobs; else the text (position in characters). Where logprobs were recorded, the
logprob gap at the fork tells a near-tie from a real fault.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from evalpipe.harness.records import Record


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing element; len(shorter) when one is a prefix; None when equal."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def token_logprobs(logprobs: Any) -> list[dict] | None:
    """Normalise the logprob shapes servers return into [{token, logprob, top: {token: logprob}}] per position.

    Accepts the legacy completions object ({tokens, token_logprobs, top_logprobs}), the chat object
    ({content: [{token, logprob, top_logprobs: [...]}]}), a list of such per-token dicts, or a list of floats.
    """
    if logprobs is None:
        return None
    if isinstance(logprobs, dict):
        if isinstance(logprobs.get("content"), list):
            return token_logprobs(logprobs["content"])
        if isinstance(logprobs.get("token_logprobs"), list):
            tokens = logprobs.get("tokens") or [None] * len(logprobs["token_logprobs"])
            tops = logprobs.get("top_logprobs") or [None] * len(tokens)
            return [
                {"token": t, "logprob": lp, "top": _top_map(top)}
                for t, lp, top in zip(tokens, logprobs["token_logprobs"], tops)
            ]
        return None
    if isinstance(logprobs, list):
        out = []
        for item in logprobs:
            if isinstance(item, dict):
                out.append(
                    {
                        "token": item.get("token", item.get("token_id")),
                        "logprob": item.get("logprob"),
                        "top": _top_map(item.get("top_logprobs")),
                    }
                )
            elif isinstance(item, (int, float)) or item is None:
                out.append({"token": None, "logprob": item, "top": {}})
            else:
                return None
        return out
    return None


def _top_map(top: Any) -> dict:
    if isinstance(top, dict):
        return {str(k): v for k, v in top.items()}
    if isinstance(top, list):
        return {str(t.get("token", t.get("token_id"))): t.get("logprob") for t in top if isinstance(t, dict)}
    return {}


def output_sequence(rec: Record) -> tuple[str, Sequence]:
    """(basis, sequence) for one record: token ids, else logprob token strings, else text."""
    ids = rec.output_token_ids
    if isinstance(ids, list):
        return "token_ids", ids
    lps = token_logprobs(rec.logprobs)
    if lps and all(p["token"] is not None for p in lps):
        return "logprob_tokens", [p["token"] for p in lps]
    text = (rec.reasoning_text or "") + (rec.response_text or "")
    return "text", text


def compare_outputs(rec_a: Record, rec_b: Record) -> dict:
    """Agreement of two records: identical?, basis, first differing position, logprob gap there."""
    basis_a, seq_a = output_sequence(rec_a)
    basis_b, seq_b = output_sequence(rec_b)
    if basis_a != basis_b:  # compare on the finest basis both records share
        if "text" in (basis_a, basis_b) or {basis_a, basis_b} != {"token_ids", "logprob_tokens"}:
            basis_a = basis_b = "text"
            seq_a = (rec_a.reasoning_text or "") + (rec_a.response_text or "")
            seq_b = (rec_b.reasoning_text or "") + (rec_b.response_text or "")
        else:
            basis_a = basis_b = "logprob_tokens"
            seq_a = [p["token"] for p in token_logprobs(rec_a.logprobs) or []]
            seq_b = [p["token"] for p in token_logprobs(rec_b.logprobs) or []]
    pos = first_divergence(seq_a, seq_b)
    out = {"identical": pos is None, "basis": basis_a, "position": pos, "len_a": len(seq_a), "len_b": len(seq_b)}
    if pos is None and basis_a != "text":
        # identical tokens must detokenize to identical text; anything else is a server or record fault
        out["text_differs"] = (rec_a.response_text or "") != (rec_b.response_text or "")
    if pos is not None and basis_a != "text":
        gap = logprob_gap(rec_a.logprobs, rec_b.logprobs, pos)
        if gap is not None:
            out["logprob"] = gap
    return out


def logprob_gap(logprobs_a: Any, logprobs_b: Any, pos: int) -> dict | None:
    """Logprobs at token position `pos` where each arm chose differently (each arm's recorded `logprobs`).

    gap: how far A preferred its own token over B's, lp_A(tok_A) - lp_A(tok_B), when B's token is in A's
    top list (a near-tie gives a gap near 0); else A's top-1 minus top-2 margin; else lp_A - lp_B of the
    two chosen tokens. `gap_kind` says which.
    """
    la, lb = token_logprobs(logprobs_a), token_logprobs(logprobs_b)
    pa = la[pos] if la and pos < len(la) else None
    pb = lb[pos] if lb and pos < len(lb) else None
    if pa is None and pb is None:
        return None
    out: dict = {
        "logprob_a": pa and pa.get("logprob"),
        "logprob_b": pb and pb.get("logprob"),
        "token_a": pa and pa.get("token"),
        "token_b": pb and pb.get("token"),
    }
    if pa and pb and pb.get("token") is not None and str(pb["token"]) in pa["top"] and pa.get("logprob") is not None:
        out["gap"] = float(pa["logprob"] - pa["top"][str(pb["token"])])
        out["gap_kind"] = "lp_a(tok_a) - lp_a(tok_b)"
    elif pa and len(pa["top"]) >= 2:
        vals = sorted((v for v in pa["top"].values() if v is not None), reverse=True)
        out["gap"] = float(vals[0] - vals[1])
        out["gap_kind"] = "top1 - top2 in A"
    elif pa and pb and pa.get("logprob") is not None and pb.get("logprob") is not None:
        out["gap"] = float(pa["logprob"] - pb["logprob"])
        out["gap_kind"] = "lp_a(tok_a) - lp_b(tok_b)"
    return out


def summarize_agreement(pairs: list[tuple[str, dict]]) -> dict:
    """Share of identical outputs and the distribution of first-divergence positions over paired records."""
    n = len(pairs)
    identical = sum(1 for _, p in pairs if p["identical"])
    positions = [p["position"] for _, p in pairs if p["position"] is not None]
    gaps = [p["logprob"]["gap"] for _, p in pairs if "logprob" in p and p["logprob"].get("gap") is not None]
    text_differs = sum(1 for _, p in pairs if p.get("text_differs"))
    bases: dict[str, int] = {}
    for _, p in pairs:
        bases[p["basis"]] = bases.get(p["basis"], 0) + 1
    return {
        "n_pairs": n,
        "n_identical": identical,
        "share_identical": identical / n if n else None,
        "basis_counts": bases,
        "first_divergence_median": float(np.median(positions)) if positions else None,
        "first_divergence_min": int(min(positions)) if positions else None,
        "first_divergence_max": int(max(positions)) if positions else None,
        "logprob_gap_median": float(np.median(gaps)) if gaps else None,
        "n_with_logprob_gap": len(gaps),
        "n_identical_tokens_but_text_differs": text_differs,
    }
