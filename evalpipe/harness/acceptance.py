"""Acceptance measured the ways the field argues about it (vLLM #42508/#42690), and a per-position baseline check in
the style of vLLM's tests/v1/spec_decode/test_acceptance_length.py (relative tolerance 0.05).

From the records' `spec` blocks (native `accept_histogram`; SGLang's `meta_info` `spec_correct_drafts_histogram`
or its older name `spec_accept_histogram`: steps that accepted exactly i drafts, i = 0..G):
- per-position acceptance: position j (1..G) is the share of verify steps that accepted at least j drafts (monotone
  non-increasing in j for block drafts);
- the request-weighted mean accept length: the mean over responses of each response's accept length (tokens per
  verify step, bonus included);
- the token-weighted mean accept length: all completion tokens over all verify steps, which long completions
  dominate;
- both means and the per-position rates by context-length bucket (prompt tokens).
Without per-response histograms, vLLM's run-level /metrics per-position counters (`spec_metrics`) give the
per-position rates (no buckets: the counters cover the whole run).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional

from evalpipe.harness import metrics
from evalpipe.harness.records import Record

CONTEXT_BUCKETS = (0, 256, 1024, 4096, 16384, 32768)  # lower edges, prompt tokens
BASELINE_SCHEMA = "evalpipe-accept-baseline/1"


def _bucket(rec: Record) -> str:
    usage = rec.usage if isinstance(rec.usage, dict) else {}
    tokens = usage.get("prompt_tokens")
    if not isinstance(tokens, int):
        return "unknown"
    lower = max(edge for edge in CONTEXT_BUCKETS if edge <= tokens)
    upper = next((edge for edge in CONTEXT_BUCKETS if edge > tokens), None)
    return f"{lower}-{upper}" if upper is not None else f"{lower}+"


def _profile(recs: list[Record]) -> Optional[dict]:
    pairs = [(r, h) for r in recs for h in [metrics.draft_histogram(r)] if h is not None and sum(h) > 0]
    if not pairs:
        return None
    width = max(len(h) for _, h in pairs)
    totals = [sum(h[i] for _, h in pairs if i < len(h)) for i in range(width)]
    steps = sum(totals)
    per_position = [sum(totals[j:]) / steps for j in range(1, width)]
    lengths = [x for x in (metrics.accept_length(r) for r, _ in pairs) if x is not None]
    return {
        "responses": len(pairs),
        "verify_steps": int(steps),
        "per_position": per_position,
        "request_weighted_accept_length": statistics.fmean(lengths) if lengths else None,
        "token_weighted_accept_length": metrics.token_weighted_accept_length(r for r, _ in pairs),
    }


def profile(recs: list[Record], spec_metrics: Any = None) -> Optional[dict]:
    """The acceptance profile of a run's records (module docstring), or None without speculative statistics."""
    ok = [r for r in recs if not r.error]
    overall = _profile(ok)
    if overall is not None:
        buckets = {}
        for name in sorted(
            {_bucket(r) for r in ok},
            key=lambda b: (b == "unknown", int(b.split("-")[0].rstrip("+")) if b != "unknown" else 0),
        ):
            sub = _profile([r for r in ok if _bucket(r) == name])
            if sub is not None:
                buckets[name] = sub
        return {
            "source": "responses",
            **overall,
            "by_context_tokens": buckets,
            "definitions": {
                "per_position": "share of verify steps that accepted at least j drafts",
                "request_weighted_accept_length": "mean over responses of tokens / verify steps",
                "token_weighted_accept_length": "all completion tokens / all verify steps",
            },
        }
    per_pos = spec_metrics.get("acceptance_per_position") if isinstance(spec_metrics, dict) else None
    if per_pos:
        return {
            "source": "metrics (run-level)",
            "per_position": list(per_pos),
            "responses": None,
            "request_weighted_accept_length": None,
            "token_weighted_accept_length": spec_metrics.get("mean_accept_length"),
            "by_context_tokens": {},
        }
    return None


def write_baseline(path: Path, acceptance: Optional[dict], server_info: Any) -> dict:
    """Write a baseline (the per-position rates and both means, with the server's speculative settings)."""
    if not acceptance or not acceptance.get("per_position"):
        raise ValueError(
            "the run has no per-position acceptance to save (speculation off, or the server reports "
            "no accept histogram and no per-position /metrics counters)"
        )
    spec = server_info.get("speculative") if isinstance(server_info, dict) else None
    baseline = {
        "schema": BASELINE_SCHEMA,
        "per_position": acceptance["per_position"],
        "request_weighted_accept_length": acceptance.get("request_weighted_accept_length"),
        "token_weighted_accept_length": acceptance.get("token_weighted_accept_length"),
        "source": acceptance.get("source"),
        "server_speculative": spec,
    }
    Path(path).write_text(json.dumps(baseline, indent=2) + "\n")
    return baseline


def read_baseline(path: Path) -> dict:
    """A baseline written by `write_baseline`; ValueError saying why for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read acceptance baseline {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("schema") != BASELINE_SCHEMA:
        raise ValueError(f"{path} is not an acceptance baseline (schema {BASELINE_SCHEMA})")
    rates = data.get("per_position")
    if not isinstance(rates, list) or not rates or not all(isinstance(x, (int, float)) for x in rates):
        raise ValueError(f"{path}: per_position must be a non-empty list of rates")
    return data


def check_baseline(acceptance: Optional[dict], baseline: dict, rtol: float) -> dict:
    """Per position j: regressed when measured < baseline x (1 - rtol); the mean accept length (token-weighted, the
    one every source has) likewise. `regressed` is True when any of them is."""
    if not acceptance or not acceptance.get("per_position"):
        return {
            "rtol": rtol,
            "regressed": True,
            "reason": "the candidate run has no per-position acceptance",
            "positions": [],
        }
    rows = []
    for j, expected in enumerate(baseline["per_position"], start=1):
        got = acceptance["per_position"][j - 1] if j <= len(acceptance["per_position"]) else None
        low = expected * (1.0 - rtol)
        rows.append(
            {
                "position": j,
                "baseline": expected,
                "measured": got,
                "relative_change": (got - expected) / expected if got is not None and expected else None,
                "regressed": got is None or got < low,
            }
        )
    mean = {
        "baseline": baseline.get("token_weighted_accept_length"),
        "measured": acceptance.get("token_weighted_accept_length"),
    }
    mean["regressed"] = (
        isinstance(mean["baseline"], (int, float))
        and isinstance(mean["measured"], (int, float))
        and mean["measured"] < mean["baseline"] * (1.0 - rtol)
    )
    regressed = [r["position"] for r in rows if r["regressed"]]
    return {
        "rtol": rtol,
        "positions": rows,
        "token_weighted_accept_length": mean,
        "regressed": bool(regressed) or bool(mean["regressed"]),
        "reason": (
            f"acceptance below baseline x (1 - {rtol:g}) at position(s) {regressed}"
            if regressed
            else "token-weighted accept length below baseline"
            if mean["regressed"]
            else ""
        ),
    }
