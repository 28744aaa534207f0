"""Summarise a run from its records alone, so `evalpipe audit` can recompute it bit for bit.

Denominators are always the *planned* items: an error, a truncation, a missing record (partial run) or an
unparsable answer all count as wrong; what each record counts as is metrics.py's, which record of a key counts is
records.py's. For the repeated lane the headline is pass@1 over all responses; pass@k / majority@k come from
sgl-eval's vendored NeMo-Skills `MathMetrics` and are secondary, and so is its `no_answer` rate (NeMo-Skills'
definition: a sample without a predicted answer, error records and missing responses included).
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Optional

from evalpipe.harness import acceptance, metrics
from evalpipe.harness.records import SCHEMA_VERSION, Counted, Record, counted_records
from evalpipe.lanes import sgl_eval_adapter


def _quantile(sorted_vals: list[float], q: float) -> Optional[float]:
    if not sorted_vals:
        return None
    idx = min(len(sorted_vals) - 1, max(0, int(round(q * (len(sorted_vals) - 1)))))
    return sorted_vals[idx]


def _usage_int(usage: Any, key: str) -> int:
    if not isinstance(usage, dict):
        return 0
    v = usage.get(key)
    return int(v) if isinstance(v, (int, float)) else 0


def _reasoning_tokens(usage: Any) -> int:
    if not isinstance(usage, dict):
        return 0
    details = usage.get("completion_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("reasoning_tokens"), (int, float)):
        return int(details["reasoning_tokens"])
    return _usage_int(usage, "reasoning_tokens")


def repeated_metrics(by_key: dict, lane_name: str, question_ids: list, repeats: int) -> dict:
    """pass@k, majority@k, no_answer and pass@1 spread via the vendored NS MathMetrics.

    A planned response with no record is fed as a wrong, answerless sample (never padded by copying)."""
    metrics = sgl_eval_adapter.math_metrics()
    for qid in question_ids:
        preds = []
        for r in range(repeats):
            rec = by_key.get((lane_name, qid, r))
            if rec is None:
                preds.append({"predicted_answer": None, "symbolic_correct": False})
            else:
                ans = rec.extracted_answer
                preds.append(
                    {
                        "predicted_answer": None if ans is None else str(ans),
                        "symbolic_correct": bool(rec.correct),
                        "num_generated_tokens": _usage_int(rec.usage, "completion_tokens"),
                    }
                )
        metrics.update(preds)
    raw = metrics.get_metrics()
    k = repeats
    avg = raw.get(f"pass@1[avg-of-{k}]", {})
    stats = avg.get("symbolic_correct_statistics", {})
    return {
        f"pass@{k}": raw.get(f"pass@{k}", {}).get("symbolic_correct", 0.0) / 100.0,
        f"majority@{k}": raw.get(f"majority@{k}", {}).get("symbolic_correct", 0.0) / 100.0,
        "no_answer": avg.get("no_answer", 0.0) / 100.0,
        "pass@1_ns": avg.get("symbolic_correct", 0.0) / 100.0,
        "pass@1_std_across_repeats": stats.get("std_dev_across_runs"),
        "pass@1_sem_across_repeats": stats.get("std_err_across_runs"),
    }


def group_accuracy(groups: dict, planned: list, by_key: dict) -> dict:
    """{group: {n_planned, n_correct, accuracy}} in first-seen order; a missing record counts wrong."""
    out: dict = {}
    for key in planned:
        g = out.setdefault(str(groups.get(key[1])), {"n_planned": 0, "n_correct": 0})
        g["n_planned"] += 1
        g["n_correct"] += key in by_key and by_key[key].correct is True
    for g in out.values():
        g["accuracy"] = g["n_correct"] / g["n_planned"]
    return out


# run-level facts copied from `meta` when present, in this order
_META_KEYS = (
    "partial",
    "interrupted",
    "refused",
    "wall_s",
    "requests_per_s",
    "overrides",
    "data_drift",
    "manifest_changed",
    "manifest_changes",
    "resumed",
    "server_lossy_acceptance",
    "server_debug_faults",
    "server_deterministic",
    "spec_metrics",
)


def compute_summary(
    *,
    lane_name: str,
    grader: str,
    repeats: int,
    planned_question_ids: list,
    records: list[Record],
    meta: dict,
    groups: Optional[dict] = None,
) -> dict:
    """The summary dict. `meta` carries run-level facts not derivable from records (arm, partial, ...);
    `groups` maps planned question ids to their lane's reporting group (accuracy per group, same denominators)."""
    planned = [(lane_name, q, r) for q in planned_question_ids for r in range(repeats)]
    counted = counted_records(records)
    by_key = counted.by_key
    recs = [by_key[k] for k in planned if k in by_key]

    summary = _headline_counts(lane_name, meta, planned, counted, recs)
    summary[metrics.no_answer_key(grader)] = sum(map(metrics.is_no_answer, recs))
    if groups:
        summary["by_group"] = group_accuracy(groups, planned, by_key)
    if repeats > 1:
        summary["pass@1"] = summary["accuracy"]
        summary.update(repeated_metrics(by_key, lane_name, planned_question_ids, repeats))
    ok_recs = [r for r in recs if not metrics.is_error(r)]
    summary["tokens"] = _token_totals(ok_recs)
    summary["latency_s"] = _latency_stats(recs)
    summary.update(_spec_stats(recs, meta))
    summary.update({key: meta[key] for key in _META_KEYS if key in meta})
    summary.setdefault("partial", summary["n_missing"] > 0)
    return summary


def _headline_counts(lane_name: str, meta: dict, planned: list, counted: Counted, recs: list[Record]) -> dict[str, Any]:
    """Identity, then planned/recorded/correct/error counts; every rate's denominator is the planned items."""
    planned_set = set(planned)
    unplanned = [k for k in counted.by_key if k not in planned_set]
    n_planned = len(planned)
    n_correct = sum(map(metrics.is_correct, recs))
    status_counts: dict[str, int] = {}
    for r in recs:
        status_counts[r.grade_status] = status_counts.get(r.grade_status, 0) + 1
    return {
        "schema_version": SCHEMA_VERSION,
        "lane": lane_name,
        "arm": meta.get("arm"),
        "run_id": meta.get("run_id"),
        "model": meta.get("model"),
        "endpoint": meta.get("endpoint"),
        "n_planned": n_planned,
        "n_records": len(recs),
        "n_missing": n_planned - len(recs),
        "n_correct": n_correct,
        "accuracy": (n_correct / n_planned) if n_planned else None,
        "accuracy_definition": "correct / n_planned (errors, truncations, missing and unanswered count as wrong)",
        "n_truncated": sum(map(metrics.is_truncated, recs)),
        "n_errors": sum(map(metrics.is_error, recs)),
        "n_grader_timeouts": status_counts.get("grader_timeout", 0),
        "n_grader_errors": status_counts.get("grader_error", 0),
        "grade_status_counts": dict(sorted((str(k), v) for k, v in status_counts.items())),
        "n_duplicate_records": counted.n_duplicates,
        "n_unplanned_records": len(unplanned),
    }


def _token_totals(ok_recs: list[Record]) -> dict:
    """Token usage over the records that are not errors."""
    completion = [_usage_int(r.usage, "completion_tokens") for r in ok_recs]
    return {
        "prompt_total": sum(_usage_int(r.usage, "prompt_tokens") for r in ok_recs),
        "completion_total": sum(completion),
        "completion_mean": (sum(completion) / len(completion)) if completion else None,
        "completion_max": max(completion) if completion else None,
        "reasoning_total": sum(_reasoning_tokens(r.usage) for r in ok_recs),
    }


def _latency_stats(recs: list[Record]) -> dict:
    """Mean, quantiles and max of the records' numeric latencies."""
    latencies = sorted(float(r.latency_s) for r in recs if isinstance(r.latency_s, (int, float)))
    return {
        "mean": statistics.fmean(latencies) if latencies else None,
        "p50": _quantile(latencies, 0.5),
        "p90": _quantile(latencies, 0.9),
        "p99": _quantile(latencies, 0.99),
        "max": latencies[-1] if latencies else None,
    }


def _spec_stats(recs: list[Record], meta: dict) -> dict:
    """Speculative-decoding statistics from the responses; run-level ones from the server's /metrics go in
    `spec_metrics`."""
    n_lossy = sum(map(metrics.is_lossy, recs))
    return {
        "n_records_with_spec": sum(map(metrics.has_spec, recs)),
        "spec_accept_length_mean": metrics.mean_accept_length(recs),
        # per position, request- and token-weighted, by context length (harness/acceptance.py)
        "acceptance": acceptance.profile(recs, meta.get("spec_metrics")),
        # a lossy acceptance rule (evalpipe serve --spec-accept-*) decided these responses: their accuracy measures it
        "n_records_lossy": n_lossy,
        "spec_lossy": n_lossy > 0,
    }


def close_values(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-9 relative (a summary written and recomputed may round differently), dicts key by key."""
    if isinstance(a, float) or isinstance(b, float):
        if a is None or b is None:
            return a is b
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(close_values(a[k], b[k]) for k in a)
    return a == b


# keys audit recomputes from records and compares (run-level facts such as wall time are not re-derivable)
RECOMPUTABLE_KEYS = (
    "lane",
    "n_planned",
    "n_records",
    "n_missing",
    "n_correct",
    "accuracy",
    "n_truncated",
    "n_errors",
    "n_grader_timeouts",
    "n_grader_errors",
    "grade_status_counts",
    "n_duplicate_records",
    "n_unplanned_records",
    "n_invalid",
    "n_no_answer",
    "pass@1",
    "tokens",
    "latency_s",
    "n_records_with_spec",
    "spec_accept_length_mean",
    "by_group",
    "n_records_lossy",
    "spec_lossy",
)
# recomputable keys a summary may lack (summaries written before these keys existed): audit accepts their absence
# only where the records give a falsy value (so deleting a true spec_lossy from a summary is still caught)
OMITTED_WHEN_FALSY = ("n_records_lossy", "spec_lossy")
