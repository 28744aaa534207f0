"""Speculative statistics from an engine's Prometheus `/metrics`, for engines that put none on a response.

vLLM reports speculation only as server-wide counters (`vllm:spec_decode_num_drafts_total`,
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total`); SGLang
(with `--enable-metrics`) counts `sglang:spec_verify_calls_total` beside `sglang:generation_tokens_total` and shows
the last batch's `sglang:spec_accept_length` / `sglang:spec_accept_rate` gauges. A snapshot before and after a
workload, subtracted, isolates that workload, as vLLM's own benchmarks do. The figures are run-level: the counters
moved by everything the server served meanwhile, and they say nothing about any one request. Gauges are recorded
as read after the workload, never subtracted.

The text format is parsed by prometheus_client's parser; counters are summed over label sets (engines, models).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import httpx

if TYPE_CHECKING:
    from evalpipe.harness.client import Server

METRICS_PATH = "/metrics"

# name in our records -> vLLM counter sample name
VLLM_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # label `position`, 0-based
SGLANG_COUNTERS = {
    "generation_tokens": "sglang:generation_tokens_total",
    "verify_calls": "sglang:spec_verify_calls_total",
}
# SGLang gauges: the last batch's values (not counters; not subtracted)
SGLANG_GAUGES = {"accept_length": "sglang:spec_accept_length", "accept_rate": "sglang:spec_accept_rate"}

SCOPE = (
    "run-level: the server's /metrics counters after the workload minus before it; covers everything the "
    "server served in between, not one request"
)


def parse(text: str) -> Optional[dict]:
    """The speculative counters and gauges in a Prometheus text exposition; None when it holds none of them.

    Raises ValueError when `text` is not the Prometheus text format."""
    from prometheus_client.parser import text_string_to_metric_families

    names = {
        **{v: ("vllm", k) for k, v in VLLM_COUNTERS.items()},
        **{v: ("sglang", k) for k, v in SGLANG_COUNTERS.items()},
    }
    gauge_names = {v: k for k, v in SGLANG_GAUGES.items()}
    counters: dict[str, dict[str, float]] = {}
    per_position: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                engine, key = names[sample.name]
                bucket = counters.setdefault(engine, {})
                bucket[key] = bucket.get(key, 0.0) + float(sample.value)
            elif sample.name == VLLM_PER_POSITION:
                pos = str(sample.labels.get("position", "?"))
                per_position[pos] = per_position.get(pos, 0.0) + float(sample.value)
            elif sample.name in gauge_names and family.type == "gauge":
                gauges[gauge_names[sample.name]] = float(sample.value)
    if "vllm" in counters or per_position:
        return {
            "engine": "vllm",
            "counters": counters.get("vllm", {}),
            "accepted_per_position": dict(sorted(per_position.items(), key=lambda kv: _pos_key(kv[0]))),
        }
    sglang = counters.get("sglang", {})
    if "verify_calls" in sglang or gauges:  # generation tokens alone say nothing about speculation
        return {"engine": "sglang", "counters": sglang, "gauges": gauges}
    return None


def _pos_key(position: str) -> tuple[int, str]:
    return (int(position), "") if position.isdigit() else (1 << 30, position)


def snapshot(server: "Server") -> Optional[dict]:
    """GET <server root>/metrics now; None when the server has no /metrics or no speculative statistics there."""
    return _from_response(server.get(METRICS_PATH))


def _from_response(response: Optional[httpx.Response]) -> Optional[dict]:
    if response is None or response.status_code != 200:
        return None
    try:
        return parse(response.text)
    except ValueError:  # a /metrics route that is not Prometheus text
        return None


def run_level(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """The workload's speculative statistics from two snapshots (None when the server reports none).

    vLLM: drafts, draft tokens, accepted tokens and accepted tokens per draft position as after - before;
    per-position acceptance = accepted at that position / drafts; mean accept length = 1 + accepted / drafts (the
    bonus token included); draft acceptance rate = accepted / draft tokens.
    SGLang: verify calls and generation tokens as after - before; mean accept length = generation tokens / verify
    calls (SGLang's own definition); its gauges as read after the workload.
    Both snapshots are kept, so every figure can be recomputed from the record.
    """
    if after is None:
        return None
    block: dict[str, Any] = {
        "level": "run",
        "scope": SCOPE,
        "source": f"GET {METRICS_PATH}",
        "engine": after.get("engine"),
        "before": before,
        "after": after,
    }
    if before is None or before.get("engine") != after.get("engine"):
        block["error"] = "no /metrics snapshot before the workload: the counters cannot be isolated"
        return block
    delta = {k: after["counters"].get(k, 0.0) - before["counters"].get(k, 0.0) for k in after["counters"]}
    per_pos: list[float] = []
    if after["engine"] == "vllm":
        positions = sorted(set(after["accepted_per_position"]) | set(before["accepted_per_position"]), key=_pos_key)
        per_pos = [
            after["accepted_per_position"].get(p, 0.0) - before["accepted_per_position"].get(p, 0.0) for p in positions
        ]
    if any(v < 0 for v in [*delta.values(), *per_pos]):
        block["error"] = "a counter went down between the snapshots (the server restarted): no figure"
        return block
    if after["engine"] == "vllm":
        drafts, draft_tokens, accepted = (delta.get(k, 0.0) for k in ("drafts", "draft_tokens", "accepted_tokens"))
        block.update(
            drafts=_int(drafts),
            draft_tokens=_int(draft_tokens),
            accepted_tokens=_int(accepted),
            accepted_per_position=[_int(v) for v in per_pos],
            acceptance_per_position=[v / drafts for v in per_pos] if drafts else None,
            draft_acceptance_rate=accepted / draft_tokens if draft_tokens else None,
            mean_accept_length=1.0 + accepted / drafts if drafts else None,
        )
    else:
        verify, tokens = delta.get("verify_calls", 0.0), delta.get("generation_tokens", 0.0)
        block.update(
            verify_calls=_int(verify),
            generation_tokens=_int(tokens),
            mean_accept_length=tokens / verify if verify else None,
            gauges_after=after.get("gauges") or {},
        )
    return block


def _int(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def accept_length(block: Optional[dict]) -> Optional[float]:
    """The run-level mean accept length of a `run_level` block, if it has one."""
    if not isinstance(block, dict):
        return None
    value = block.get("mean_accept_length")
    return float(value) if isinstance(value, (int, float)) else None
