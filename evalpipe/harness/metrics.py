"""What a record counts as: the one definition that summary.json, `evalpipe audit` and compare.json share.

Every record that counts (records.counted_records) has exactly one outcome:
  error      the request failed for good (`error` set): no response to grade
  truncated  the response stopped at max_tokens (finish_reason "length"): wrong, whatever the text says
  no_answer  a complete response with nothing to grade: grade_status "no_answer" (GSM8K's INVALID, no digits; AIME:
             no \\boxed{}; exact-text lanes: an empty reply). summary.json calls it `n_invalid` on the legacy GSM8K
             grader and `n_no_answer` on the others; compare.json's rate is `invalid`.
  graded     correct or wrong (grade_status "ok", or a grader timeout / error, which counts wrong)
A planned response without a record is missing and counts wrong too; accuracy = correct / planned.
Accept length per record: the server's figure on the record's `spec`, else completion tokens / verify steps.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Optional

from evalpipe.harness.records import Record

NO_ANSWER = "no_answer"  # the grade status of a complete response with nothing to grade

ACCEPT_LENGTH_KEYS = ("accept_length", "spec_accept_length", "avg_accept_length", "mean_accept_length")
VERIFY_STEP_KEYS = ("verify_steps", "verify_ct", "spec_verify_ct", "num_verify_steps")
SPEC_TOKEN_KEYS = ("num_tokens", "accepted_tokens_total")
# Steps that accepted exactly i drafts, i = 0..G: the native `accept_histogram`; SGLang's meta_info
# `spec_correct_drafts_histogram`, and `spec_accept_histogram`, the older name it still sends.
DRAFT_HISTOGRAM_KEYS = ("accept_histogram", "spec_correct_drafts_histogram", "spec_accept_histogram")


def is_error(rec: Record) -> bool:
    return bool(rec.error)


def is_truncated(rec: Record) -> bool:
    return not is_error(rec) and (bool(rec.truncated) or rec.finish_reason == "length")


def is_no_answer(rec: Record) -> bool:
    return not is_error(rec) and not is_truncated(rec) and rec.grade_status == NO_ANSWER


def is_correct(rec: Record) -> bool:
    return rec.correct is True and not is_error(rec) and not is_truncated(rec)


# compare.json's rate names, in its order
RATES = (("truncated", is_truncated), ("error", is_error), ("invalid", is_no_answer))


def no_answer_key(grader: str) -> str:
    """summary.json's name for the no-answer count: GSM8K's legacy scorer calls it INVALID."""
    return "n_invalid" if grader == "legacy_last_int" else "n_no_answer"


def completion_tokens(rec: Record) -> Optional[int]:
    """The server's usage.completion_tokens, else the number of output token ids, else None."""
    usage = rec.usage or {}
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), (int, float)):
        return int(usage["completion_tokens"])
    ids = rec.output_token_ids
    return len(ids) if isinstance(ids, list) else None


def first_number(d: dict, names: tuple[str, ...]) -> Optional[float]:
    for name in names:
        value = d.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    return None


def accept_length(rec: Record) -> Optional[float]:
    """The record's mean accept length (bonus token included), or None without speculative statistics."""
    spec = rec.spec
    if not isinstance(spec, dict):
        return None
    value = first_number(spec, ACCEPT_LENGTH_KEYS)
    if value is not None:
        return float(value)
    verify = verify_steps(rec)
    tokens = first_number(spec, SPEC_TOKEN_KEYS) or completion_tokens(rec)
    return tokens / verify if verify and tokens else None


def draft_histogram(rec: Record) -> Optional[list[float]]:
    """The record's verify steps by accepted drafts (index i: steps that accepted exactly i), or None."""
    spec = rec.spec
    if not isinstance(spec, dict):
        return None
    for key in DRAFT_HISTOGRAM_KEYS:
        hist = spec.get(key)
        if isinstance(hist, list) and hist and all(_is_number(h) for h in hist):
            return [float(h) for h in hist]
    return None


def verify_steps(rec: Record) -> Optional[float]:
    """The record's verify steps: the server's count, else the sum of its draft histogram, else None."""
    spec = rec.spec
    if not isinstance(spec, dict):
        return None
    count = first_number(spec, VERIFY_STEP_KEYS)
    if count is not None:
        return count
    hist = draft_histogram(rec)
    return sum(hist) if hist else None


def token_weighted_accept_length(recs: Iterable[Record]) -> Optional[float]:
    """All completion tokens over all verify steps, over the records that carry both (long completions dominate)."""
    tokens = steps = 0.0
    for rec in recs:
        spec = rec.spec
        if not isinstance(spec, dict):
            continue
        n_steps = verify_steps(rec)
        n_tokens = first_number(spec, SPEC_TOKEN_KEYS) or completion_tokens(rec)
        if n_steps and n_tokens:
            tokens += n_tokens
            steps += n_steps
    return tokens / steps if steps else None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def mean_accept_length(recs: Iterable[Record]) -> Optional[float]:
    """Mean of the per-record accept lengths (records without one left out), or None."""
    values = [x for x in map(accept_length, recs) if x is not None]
    return statistics.fmean(values) if values else None


def is_lossy(rec: Record) -> bool:
    """A lossy acceptance rule decided this response (`evalpipe serve --spec-accept-*`)."""
    return isinstance(rec.spec, dict) and rec.spec.get("lossy") is True


def has_spec(rec: Record) -> bool:
    return isinstance(rec.spec, dict)
