"""The run folder: its file names, the per-response record, the record key and the one duplicate rule.

A record is one JSON object per line of `responses.jsonl`, appended and flushed as its response lands (a crash or
Ctrl-C loses only in-flight work). Every number in summary.json is re-derivable from these lines (`evalpipe audit`
does that), and arms are joined on `record_key` = (lane, question_id, repeat_index). Read with `read_records`
(raw JSON objects; it tolerates a torn last line), then `ReadResult.typed` or `Record.from_json` (typed `Record`s),
and `counted_records`.

Duplicates: `evalpipe run` writes each key once, but two resumes at once or a hand edit can write a key twice. Then
the record that counts, in summary.json, audit and compare.json alike, is the key's FIRST NON-ERROR record in file
order, else its LAST error record (the latest failure). That is what `--resume` keeps: it never re-asks a key with a
non-error record, retries a key with only errors, and moves every record that does not count to superseded.jsonl.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable, Optional

from evalpipe.harness.server_facts import spec_from_response

SCHEMA_VERSION = 1

RESPONSES_FILE = "responses.jsonl"
SUMMARY_FILE = "summary.json"
MANIFEST_FILE = "manifest.json"
SUPERSEDED_FILE = "superseded.jsonl"  # records that no longer count: error records retried by --resume, duplicates
REPEAT_FILE = "repeat.json"  # `evalpipe repeat`'s result beside its records
BENCH_FILE = "bench.json"  # `evalpipe bench` writes only this
AB_FILE = "ab.json"  # `evalpipe ab`'s index of its arms, their run folders and the flags that differ between them


@dataclass
class Record:
    """One line of `responses.jsonl`, fields in writing order. `as_json` omits `group` when it is None (lanes
    without groups) and is what `RecordWriter` gets; `from_json` reads one line's object back."""

    schema_version: int
    run_id: str
    arm: str
    lane: str
    question_id: Any
    repeat_index: int
    request_seq: int
    endpoint: str
    model: str
    prompt_sha256: str
    group: Any  # optional: the item's reporting group, on lanes that have groups (e.g. arith's number of operations)
    request: dict  # the body exactly as sent, minus the API key (which never is in the body)
    response_text: str  # choice text (completions) or message.content (chat); "" on error
    reasoning_text: Optional[str]  # message.reasoning_content / reasoning when the server split it out, else null
    finish_reason: Optional[str]
    matched_stop: Any  # the stop string/token the server says it matched, else null
    truncated: bool  # finish_reason == "length"
    error: Optional[dict]  # null or {"type", "status", "message"}
    attempts: list  # [{"start", "end", "error"}] one per try, last one decides the record
    usage: Optional[dict]  # the server's usage block verbatim, or null
    latency_s: float  # client wall time of the deciding attempt
    spec: Optional[dict]  # speculative statistics the server reported on the choice / response, else null
    output_token_ids: Optional[list]  # choice token_ids when the server returned them, else null
    logprobs: Any  # choice logprobs when requested and returned, else null
    response_id: Optional[str]  # optional: the response's `id`
    model_reported: Optional[str]  # optional: the response's `model`
    # optional: the server's deterministic (batch-invariant) mode as the run found it before its first request
    # (plan.ServerIdentity.deterministic); null: unknown
    server_deterministic: Optional[bool]
    extracted_answer: Any
    expected_answer: Any
    correct: bool  # errors and truncations are always False
    grade_status: str  # see GRADE_STATUSES
    created_at: float  # unix time the record was written

    def as_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if out["group"] is None:
            del out["group"]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "Record":
        """The Record of one line's JSON object; an absent optional key (OPTIONAL_KEYS) reads as None.

        Keys that are not fields (an import's `source`) are left out: nothing that counts records reads them, and
        the files that are rewritten (--resume) are rewritten from the raw objects, so no line loses them.
        MissingKeys when a required key is absent. Values are taken as they are, not type-checked: audit is what
        judges a record's values."""
        missing = missing_keys(obj)
        if missing:
            raise MissingKeys(missing)
        return cls(**{name: obj.get(name) for name in _FIELD_NAMES})


class MissingKeys(ValueError):
    """A record object lacks required keys (the message lists them)."""

    def __init__(self, keys: list[str]):
        super().__init__(f"missing keys {keys}")
        self.keys = keys


_FIELD_NAMES = tuple(f.name for f in fields(Record))


# Keys audit does not require: `group` (absent on lanes without groups), what the response body said of itself, and
# `server_deterministic` (absent from records written before it was recorded).
OPTIONAL_KEYS = ("group", "response_id", "model_reported", "server_deterministic")
# Keys every record carries, in writing order (`Record`'s fields less the optional ones).
REQUIRED_KEYS: tuple[str, ...] = tuple(f.name for f in fields(Record) if f.name not in OPTIONAL_KEYS)

# ok: graded from the text. no_answer: nothing extractable (AIME: no \boxed{}; GSM8K: no digits = INVALID).
# truncated: finish_reason "length", scored wrong whatever the text says. request_error: no response.
# grader_timeout / grader_error: the grader worker hung past its hard timeout or raised.
GRADE_STATUSES = ("ok", "no_answer", "truncated", "request_error", "grader_timeout", "grader_error")


def record_key(record: Record) -> tuple[Any, Any, int]:
    """(lane, question_id, repeat_index): the uniqueness key inside one run and the join key between arms.

    A question id that is not an int or str (a hand-made file) is keyed by its canonical JSON."""
    qid = record.question_id
    if not isinstance(qid, (int, str)):
        qid = json.dumps(qid, sort_keys=True)
    return (record.lane, qid, int(record.repeat_index or 0))


@dataclass
class Counted:
    by_key: dict  # record_key -> the record that counts, keys in order of first appearance
    superseded: list[Record]  # every other record, in file order

    @property
    def n_duplicates(self) -> int:
        return len(self.superseded)


def counted_records(records: Iterable[Record]) -> Counted:
    """Which record of each key counts (module docstring): the first non-error one, else the last error."""
    by_key: dict = {}  # key -> (position, record)
    superseded: list[tuple[int, Record]] = []
    for i, rec in enumerate(records):
        key = record_key(rec)
        old = by_key.get(key)
        if old is None:
            by_key[key] = (i, rec)
        elif old[1].error:  # a later record replaces an error: a non-error one, or the newer failure
            superseded.append(old)
            by_key[key] = (i, rec)
        else:
            superseded.append((i, rec))
    return Counted(
        {k: rec for k, (_, rec) in by_key.items()}, [rec for _, rec in sorted(superseded, key=lambda p: p[0])]
    )


def response_fields(reply, chat: bool) -> dict:
    """The record fields a `client.Reply` fills, in writing order; a failed request gets empty text, no finish."""
    data = reply.data or {}
    choice = data["choices"][0] if data else {}
    msg = (choice.get("message") or {}) if chat else {}
    finish = choice.get("finish_reason")
    return {
        "response_text": (msg.get("content") if chat else choice.get("text")) or "",
        "reasoning_text": (msg.get("reasoning_content") or msg.get("reasoning")) if chat else None,
        "finish_reason": finish,
        "matched_stop": choice.get("matched_stop"),
        "truncated": finish == "length",
        "error": reply.error,
        "attempts": reply.attempts,
        "usage": data.get("usage"),
        "latency_s": reply.latency_s,
        "spec": spec_from_response(data, choice) if data else None,
        "output_token_ids": choice.get("token_ids"),
        "logprobs": choice.get("logprobs"),
        "response_id": data.get("id"),
        "model_reported": data.get("model"),
    }


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
    why: dict = field(default_factory=dict)  # bad line number -> what is wrong with it
    line_numbers: list = field(default_factory=list)  # 1-based line of each record in `records`

    def typed(self, path: Path) -> list[Record]:
        """The records as `Record`s; MalformedFile names the first line that lacks a required key."""
        out = []
        for line, obj in zip(self.line_numbers, self.records):
            try:
                out.append(Record.from_json(obj))
            except MissingKeys as exc:
                raise MalformedFile(f"{path}:{line}: {exc}") from None
        return out

    def first_bad(self, path: Path) -> str:
        """`FILE:LINE: reason` of the first bad line, and how many more there are (for an error message)."""
        line = self.bad_lines[0]
        more = len(self.bad_lines) - 1
        return f"{path}:{line}: {self.why.get(line, 'not a JSON object')}" + (
            f" (and {more} more bad line(s))" if more else ""
        )


def read_records(path: Path) -> ReadResult:
    """Read `responses.jsonl`, keeping every valid line; a torn final line is reported, not raised.

    Lines are decoded one by one, so bytes that are not UTF-8 make that line bad (reported with its number), not the
    whole file unreadable."""
    path = Path(path)
    records: list[dict] = []
    bad: list[int] = []
    why: dict[int, str] = {}
    numbers: list[int] = []
    torn = False
    if not path.exists():
        return ReadResult([], False, [])
    lines = path.read_bytes().split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
            problem = None if isinstance(obj, dict) else f"a JSON {type(obj).__name__}, not an object"
        except UnicodeDecodeError as exc:
            problem = f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
        except ValueError as exc:
            problem = f"not valid JSON ({exc})"
        if problem is None:
            records.append(obj)
            numbers.append(i + 1)
        elif i == len(lines) - 1:
            torn = True  # no trailing newline: the writer died mid-line (maybe inside a UTF-8 sequence)
        else:
            bad.append(i + 1)
            why[i + 1] = problem
    return ReadResult(records, torn, bad, why, numbers)


class MalformedFile(Exception):
    """A file that is not what it should be; the message is `FILE:LINE: what is wrong` (no traceback needed)."""


def read_json_object(path: Path) -> dict:
    """One JSON object from `path`; MalformedFile names the file and the line of the first problem."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise MalformedFile(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise MalformedFile(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x})") from None
    except json.JSONDecodeError as exc:
        raise MalformedFile(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise MalformedFile(f"{path}:1: a JSON {type(obj).__name__}, not an object")
    return obj


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
