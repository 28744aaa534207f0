"""The per-response record: one JSON object per line of `responses.jsonl`.

Why a fixed schema: the spec-on and spec-off arms are joined on `(lane, question_id, repeat_index)` and
every number in `summary.json` must be re-derivable from these lines alone (`evalpipe audit` does that).
Records are appended and flushed as each response lands, so a crash or Ctrl-C loses only in-flight work.

Readers (e.g. `evalpipe compare`) should use `read_records`, which tolerates a torn last line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

SCHEMA_VERSION = 1

RESPONSES_FILE = "responses.jsonl"
SUMMARY_FILE = "summary.json"
MANIFEST_FILE = "manifest.json"
SUPERSEDED_FILE = "superseded.jsonl"  # error records replaced by a --resume retry

# Keys every record carries (the list plus the project additions), in writing order.
REQUIRED_KEYS: tuple[str, ...] = (
    "schema_version",
    "run_id",
    "arm",
    "lane",
    "question_id",
    "repeat_index",
    "request_seq",
    "endpoint",
    "model",
    "prompt_sha256",
    "request",  # the body exactly as sent, minus the API key (which never is in the body)
    "response_text",  # choice text (completions) or message.content (chat); "" on error
    "reasoning_text",  # message.reasoning_content / reasoning when the server split it out, else null
    "finish_reason",
    "matched_stop",  # the stop string/token the server says it matched, else null
    "truncated",  # finish_reason == "length"
    "error",  # null or {"type", "status", "message"}
    "attempts",  # [{"start", "end", "error"}] one per try, last one decides the record
    "usage",  # the server's usage block verbatim, or null
    "latency_s",  # client wall time of the deciding attempt
    "spec",  # speculative statistics the server reported on the choice / response, else null
    "output_token_ids",  # choice token_ids when the server returned them, else null
    "logprobs",  # choice logprobs when requested and returned, else null
    "extracted_answer",
    "expected_answer",
    "correct",  # bool; errors and truncations are always False
    "grade_status",  # see GRADE_STATUSES
    "created_at",  # unix time the record was written
)

# Optional keys: "group" (the item's reporting group, on lanes that have groups, e.g. arith's number of operations).

# ok: graded from the text. no_answer: nothing extractable (AIME: no \boxed{}; GSM8K: no digits = INVALID).
# truncated: finish_reason "length", scored wrong whatever the text says. request_error: no response.
# grader_timeout / grader_error: the grader worker hung past its hard timeout or raised.
GRADE_STATUSES = ("ok", "no_answer", "truncated", "request_error", "grader_timeout", "grader_error")


def record_key(record: dict) -> tuple[str, Any, int]:
    """The join key between arms and the uniqueness key inside one run."""
    return (record["lane"], record["question_id"], record["repeat_index"])


class RecordWriter:
    """Single appender for `responses.jsonl`: one `write` + `flush` per record.

    `fsync=True` additionally forces each line to disk (survives a power cut, costs throughput);
    the default relies on flush, which survives a killed process.
    """

    def __init__(self, path: Path, fsync: bool = False):
        self.path = Path(path)
        self._fh = open(self.path, "a", encoding="utf-8")
        self._fsync = fsync
        self.n_written = 0

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._fh.flush()
        if self._fsync:
            os.fsync(self._fh.fileno())
        self.n_written += 1

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class ReadResult:
    records: list[dict]
    torn_tail: bool  # the last line was cut mid-write (killed process); it is not in `records`
    bad_lines: list[int]  # 1-based line numbers that are not valid JSON objects (other than a torn tail)


def read_records(path: Path) -> ReadResult:
    """Read `responses.jsonl`, keeping every valid line; a torn final line is reported, not raised."""
    path = Path(path)
    records: list[dict] = []
    bad: list[int] = []
    torn = False
    if not path.exists():
        return ReadResult([], False, [])
    with open(path, "r", encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise ValueError("not an object")
        except ValueError:
            if i == len(lines) - 1:
                torn = True  # no trailing newline: the writer died mid-line
            else:
                bad.append(i + 1)
            continue
        records.append(obj)
    return ReadResult(records, torn, bad)


def missing_keys(record: dict) -> list[str]:
    return [k for k in REQUIRED_KEYS if k not in record]


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (tmp + rename) so a reader never sees half a summary or manifest."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=2, sort_keys=False, ensure_ascii=False, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def rewrite_records(path: Path, records: Iterable[dict]) -> None:
    """Replace `responses.jsonl` atomically (used only by --resume to drop superseded error records)."""
    path = Path(path)
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
    os.replace(tmp, path)
