"""Run folders made from another harness's output (`evalpipe import lm-eval|sgl-eval`), so compare and audit read them.

An importer turns the source's files into `Imported`: one record per (doc id, repeat) with what the source kept, and
the provenance it recorded. `write_run_folder` writes responses.jsonl, summary.json and manifest.json in evalpipe's
own shapes: the manifest's start and end snapshot is one snapshot (`imported` says the source made it), whose
`prompts.prompt_stream_sha256_selected` hashes the prompts in doc-id order, `dataset.selected_id_list_sha256` the doc
ids and `lane.spec` the source's task configuration, so compare's refusals (other questions, other task config)
apply as they do to native runs. What the source did not record is listed in `imported.not_recorded` and is null in
every record, never guessed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from evalpipe.digest import file_sha256
from evalpipe.harness.records import (
    MANIFEST_FILE,
    RESPONSES_FILE,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    MalformedFile,
    Record,
    RecordWriter,
    read_records,
    write_json,
)
from evalpipe.harness.summary import compute_summary
from evalpipe.lanes import canonical_json, id_list_sha256, prompt_sha256, prompt_stream_sha256, sha256_hex


class ImportSourceError(MalformedFile):
    """The source folder is missing a file, holds a file of another kind, or a malformed one (message: FILE:LINE)."""


@dataclass
class Imported:
    tool: str  # "lm-eval" | "sgl-eval"
    version: Optional[str]
    lane: str  # "<tool>/<task>", the join key's first part
    run_id: str
    model: Optional[str]
    base_url: Optional[str]
    records: list[dict]  # question_id, repeat_index, prompt, response_text, extracted/expected answer, correct, ...
    task_config: Any  # the source's task configuration, compared between arms like a lane protocol
    params: dict  # the generation parameters the source recorded
    repeats: int
    source: dict  # source_dir, files {name: sha256}, model_args, score the source reported, ...
    not_recorded: list[str]
    grader: Optional[str] = None  # evalpipe's name of the source's grader when it is one evalpipe has (audit re-grades)
    created_at: Optional[float] = None
    dataset_sha256: Optional[str] = None  # identity of the documents asked (each importer's `dataset_sha256`)


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; ImportSourceError names the first bad line (a source file is
    finished when it is imported, so a cut-off last line is bad too)."""
    path = Path(path)
    if not path.is_file():
        raise ImportSourceError(f"{path}: no such file")
    read = read_records(path)
    if read.bad_lines:
        raise ImportSourceError(read.first_bad(path))
    if read.torn_tail:
        last = path.read_bytes().count(b"\n") + 1
        raise ImportSourceError(f"{path}:{last}: the last line is cut off (no newline after an incomplete object)")
    return list(zip(read.line_numbers, read.records))


def record_prompt_sha256(prompt: Any) -> Optional[str]:
    return prompt_sha256(prompt) if isinstance(prompt, (str, list)) else None


def stream_of(records: list[dict]) -> Optional[str]:
    """Prompt-stream hash in (doc id, repeat) order, over repeat 0; None when any prompt is unknown."""
    firsts = sorted((r for r in records if r["repeat_index"] == 0), key=lambda r: id_order(r["question_id"]))
    digests = [r.get("prompt_sha256") for r in firsts]
    return prompt_stream_sha256(digests) if digests and all(digests) else None


def id_order(qid: Any) -> tuple:
    return (0, qid, "") if isinstance(qid, int) else (1, 0, str(qid))


def question_ids(records: list[dict]) -> list:
    return sorted({r["question_id"] for r in records}, key=id_order)


def full_records(imp: Imported, arm: str) -> list[dict]:
    """evalpipe records (REQUIRED_KEYS, with nulls for what the source lacks) plus `source` (where each came from)."""
    out = []
    for seq, r in enumerate(imp.records, 1):
        rec = {
            "schema_version": SCHEMA_VERSION,
            "run_id": imp.run_id,
            "arm": arm,
            "lane": imp.lane,
            "question_id": r["question_id"],
            "repeat_index": r["repeat_index"],
            "request_seq": seq,
            "endpoint": imp.base_url,
            "model": imp.model,
            "prompt_sha256": r.get("prompt_sha256"),
        }
        rec.update(
            {
                k: r.get(k)
                for k in ("request", "response_text", "reasoning_text", "finish_reason", "matched_stop", "truncated")
            }
        )
        rec["error"] = r.get("error")
        rec["attempts"] = []
        rec.update(
            {
                k: r.get(k)
                for k in (
                    "usage",
                    "latency_s",
                    "spec",
                    "output_token_ids",
                    "logprobs",
                    "extracted_answer",
                    "expected_answer",
                    "correct",
                    "grade_status",
                )
            }
        )
        rec["created_at"] = imp.created_at
        if r.get("group") is not None:
            rec["group"] = r["group"]
        rec["source"] = r.get("source")
        out.append(rec)
    return out


def snapshot(imp: Imported) -> dict:
    """The provenance snapshot (start == end) in the sections compare reads."""
    qids = question_ids(imp.records)
    return {
        "captured_at": imp.created_at,
        "imported": True,
        "dataset": {
            "sha256": imp.dataset_sha256,
            "selected_id_list_sha256": id_list_sha256(qids),
            "selected_n_items": len(qids),
        },
        "prompts": {"prompt_stream_sha256_selected": stream_of(imp.records)},
        "lane": {
            "spec": imp.task_config,
            "overrides": {},
            "effective": {"params": imp.params, "repeats": imp.repeats, "model": imp.model},
        },
        "endpoint": {"base_url": imp.base_url, "model": imp.model},
        "server": None,
        "packages": [f"{imp.tool}=={imp.version}"] if imp.version else [],
    }


def write_run_folder(imp: Imported, out: Path, arm: Optional[str] = None) -> dict:
    """Write the run folder (refusing a non-empty `out`); returns its summary."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; give a new folder to --out")
    out.mkdir(parents=True, exist_ok=True)
    arm = arm or imp.run_id
    records = full_records(imp, arm)
    with RecordWriter(out / RESPONSES_FILE) as writer:
        for rec in records:
            writer.write(rec)
    summary = compute_summary(
        lane_name=imp.lane,
        grader=imp.grader or "imported",
        repeats=imp.repeats,
        planned_question_ids=question_ids(records),
        records=[Record.from_json(r) for r in records],
        meta={
            "arm": arm,
            "run_id": imp.run_id,
            "model": imp.model,
            "endpoint": imp.base_url,
            # a source that says it stopped early is partial, as is a missing repeat
            **({"partial": True} if imp.source.get("partial") else {}),
        },
    )
    write_json(out / SUMMARY_FILE, summary)
    snap = snapshot(imp)
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "run_id": imp.run_id,
        "arm": arm,
        "lane": imp.lane,
        "imported": {
            "tool": imp.tool,
            "version": imp.version,
            "grader": imp.grader,
            "not_recorded": imp.not_recorded,
            "imported_at": time.time(),
            **imp.source,
        },
        "start": snap,
        "end": snap,
        "consistent": True,
        "differences": [],
        "counts": {k: summary.get(k) for k in ("n_planned", "n_records", "n_errors", "n_truncated")},
        "responses_sha256": file_sha256(out / RESPONSES_FILE),
    }
    write_json(out / MANIFEST_FILE, manifest)
    return summary


def files_sha256(paths: list[Path]) -> dict:
    return {p.name: file_sha256(p) for p in paths}


def config_sha256(config: Any) -> str:
    return sha256_hex(canonical_json(config))
