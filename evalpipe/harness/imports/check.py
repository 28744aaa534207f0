"""`evalpipe audit` of an imported run folder: what can be re-derived from its records and the source's own files.

Checks (the same names as a native audit's, each OK / FAIL):
  records   every line has the record keys, and run/arm/lane of the manifest; responses.jsonl is unchanged since import
  prompts   every prompt's sha256 (and lm-eval's own doc, prompt and target hashes) re-computed; the prompt stream,
            id list and dataset hashes of the manifest re-computed from the records
  grades    where the source's grader is one evalpipe has, every response re-graded: the verdict must agree
  complete  every (doc id, repeat) exactly once, each doc id with every repeat
  summary   summary.json equals a summary recomputed from the records
  manifest  the source files still where they were have the sha256 recorded at import (a note when moved); lm-eval's
            task hash re-computed when the samples file held one filter
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Callable, Optional

from evalpipe.digest import file_sha256
from evalpipe.harness.imports import lm_eval as lm_eval_import
from evalpipe.harness.imports import question_ids, stream_of
from evalpipe.harness.imports import sgl_eval as sgl_eval_import
from evalpipe.harness.records import RESPONSES_FILE, Record, missing_keys, read_records
from evalpipe.harness.summary import RECOMPUTABLE_KEYS, close_values, compute_summary
from evalpipe.lanes import id_list_sha256, prompt_sha256, sha256_hex
from evalpipe.lanes.grading import legacy_answer_value


def audit_imported(
    run_dir: Path,
    man: dict,
    summ: Optional[dict],
    checks: dict,
    warnings: list,
    regrade: Callable[..., list],
    grader_workers: int,
    progress: bool,
) -> Optional[dict]:
    """Fill `checks` (name -> Check) for the imported folder; returns the recomputed summary."""
    info = man["imported"]
    snap = man.get("start") or {}
    records = check_records(run_dir, man, checks["records"].problems)
    check_prompts(records, info, snap, checks["prompts"].problems)
    check_grades(records, info, checks["grades"], regrade, grader_workers, progress)
    repeats = ((snap.get("lane") or {}).get("effective") or {}).get("repeats") or 1
    check_complete(records, repeats, man.get("counts") or {}, checks["complete"].problems)
    again = None
    if summ is not None:
        again = recheck_summary(records, man, summ, info.get("grader"), repeats, checks["summary"].problems)
    check_sources(records, info, checks["manifest"])
    if info.get("not_recorded"):
        warnings.append(f"not recorded by {info.get('tool')}: {', '.join(info['not_recorded'])}")
    return again


def check_records(run_dir: Path, man: dict, problems: list) -> list[dict]:
    """The records with every key, each of the manifest's run, arm and lane; the problems of the others."""
    read = read_records(run_dir / RESPONSES_FILE)
    if read.torn_tail:
        problems.append("the last line of responses.jsonl is cut off")
    pinned = man.get("responses_sha256")
    if pinned and file_sha256(run_dir / RESPONSES_FILE) != pinned:
        problems.append("responses.jsonl changed after the import (sha256 differs from manifest.json)")
    records = []
    for i, r in enumerate(read.records, 1):
        miss = missing_keys(r)
        if miss:
            problems.append(f"record {i}: missing keys {miss}")
            continue
        for k in ("run_id", "arm", "lane"):
            if r.get(k) != man.get(k):
                problems.append(f"record {i}: {k}={r.get(k)!r}, manifest says {man.get(k)!r}")
        records.append(r)
    return records


def check_prompts(records: list[dict], info: dict, snap: dict, problems: list) -> None:
    """Every prompt's sha256 and the source's own hashes; the stream, id list and dataset hashes of the manifest."""
    for r in records:
        where = f"{r['question_id']}/{r['repeat_index']}"
        src = r.get("source") or {}
        prompt = (r.get("request") or {}).get("prompt") if isinstance(r.get("request"), dict) else src.get("problem")
        if prompt is not None and r.get("prompt_sha256") != prompt_sha256(prompt):
            problems.append(f"{where}: prompt_sha256 is not the sha256 of the recorded prompt")
        if info.get("tool") == lm_eval_import.TOOL:
            problems += [f"{where}: {p}" for p in lm_eval_hash_problems(src, prompt)]
    want = (snap.get("prompts") or {}).get("prompt_stream_sha256_selected")
    if stream_of(records) != want:
        problems.append("the prompt stream of the records differs from the manifest's")
    if id_list_sha256(question_ids(records)) != (snap.get("dataset") or {}).get("selected_id_list_sha256"):
        problems.append("the doc id list of the records differs from the manifest's")
    importer = lm_eval_import if info.get("tool") == lm_eval_import.TOOL else sgl_eval_import
    if importer.dataset_sha256(records) != (snap.get("dataset") or {}).get("sha256"):
        problems.append("the dataset hash re-computed from the records differs from the manifest's")


def lm_eval_hash_problems(src: dict, prompt) -> list[str]:
    problems = []
    if src.get("prompt_hash") and isinstance(prompt, str) and src["prompt_hash"] != sha256_hex(prompt):
        problems.append("lm-eval's prompt_hash is not the sha256 of the prompt")
    if src.get("doc_hash") and src["doc_hash"] != lm_eval_import.doc_hash(src.get("doc")):
        problems.append("lm-eval's doc_hash is not the hash of the recorded doc")
    if src.get("target_hash") and src["target_hash"] != sha256_hex(str(src.get("target"))):
        problems.append("lm-eval's target_hash is not the hash of the recorded target")
    return problems


def check_grades(records: list[dict], info: dict, check, regrade: Callable[..., list], workers: int, progress: bool):
    """Every response re-graded where evalpipe has the source's grader (lm-eval's acc from the loglikelihoods)."""
    grader = info.get("grader")
    if grader:
        gradable = [r for r in records if not r.get("error")]
        # the source graded whatever text came back (no truncation rule); gold as the grader reads it
        as_graded = [
            Record.from_json(
                {
                    **r,
                    "finish_reason": None,
                    "expected_answer": legacy_answer_value(str(r["expected_answer"]))
                    if grader == "legacy_last_int"
                    else r["expected_answer"],
                }
            )
            for r in gradable
        ]
        for r, (_, correct, status) in zip(gradable, regrade(grader, as_graded, 30.0, workers, progress)):
            if bool(correct) != bool(r["correct"]):
                check.problems.append(
                    f"{r['question_id']}/{r['repeat_index']}: the source says correct="
                    f"{r['correct']}, evalpipe's {grader} grader says {correct} ({status})"
                )
    elif info.get("tool") == lm_eval_import.TOOL and info.get("metric") == "acc":
        check.problems += [p for r in records for p in multiple_choice_problems(r)]
    else:
        check.notes.append("the source's grader is not one evalpipe has; grades are the source's")


def multiple_choice_problems(r: dict) -> list[str]:
    """A multiple-choice record is right when the best-scoring choice is the target's index."""
    best = lm_eval_import.best_choice(r.get("logprobs"))
    target = str(r.get("expected_answer"))
    if best is None or not target.isdigit():
        return [f"{r['question_id']}: no choice loglikelihoods or no target index to re-derive acc"]
    if (best == int(target)) != bool(r["correct"]) or best != r.get("extracted_answer"):
        return [
            f"{r['question_id']}: the source says correct={r['correct']}, the best of "
            f"the recorded loglikelihoods is choice {best}, the target {target}"
        ]
    return []


def check_complete(records: list[dict], repeats: int, counts: dict, problems: list) -> None:
    """Every (doc id, repeat) exactly once, each doc id with every repeat, as many as the manifest counted."""
    keys = Counter((r["question_id"], r["repeat_index"]) for r in records)
    dups = [k for k, n in keys.items() if n > 1]
    if dups:
        problems.append(f"{len(dups)} (doc id, repeat) keys have more than one record, e.g. {dups[:5]}")
    per_q = Counter(q for q, _ in keys)
    short = [q for q in per_q if per_q[q] != repeats]
    if short:
        problems.append(f"{len(short)} doc ids lack some of the {repeats} repeats, e.g. {short[:5]}")
    if counts.get("n_records") is not None and counts["n_records"] != len(keys):
        problems.append(f"{len(keys)} records, the manifest counted {counts['n_records']}")


def recheck_summary(records: list[dict], man: dict, summ: dict, grader, repeats: int, problems: list) -> dict:
    """summary.json against a summary recomputed from the records; the recomputed one."""
    again = compute_summary(
        lane_name=man.get("lane"),
        grader=grader or "imported",
        repeats=repeats,
        planned_question_ids=question_ids(records),
        records=[Record.from_json(r) for r in records],
        meta={k: summ.get(k) for k in ("arm", "run_id", "model", "endpoint")},
    )
    for k in RECOMPUTABLE_KEYS:
        if (k in again or k in summ) and not close_values(summ.get(k), again.get(k)):
            problems.append(f"{k}: summary.json says {summ.get(k)!r}, records give {again.get(k)!r}")
    return again


def check_sources(records: list[dict], info: dict, check) -> None:
    """The source files still where they were have their import sha256; lm-eval's task hash where it can be redone."""
    source_dir = Path(info.get("source_dir") or "")
    for name, sha in (info.get("files_sha256") or {}).items():
        path = source_dir / name
        if not path.is_file():
            check.notes.append(f"source file {path} not present here; its records are checked alone")
        elif file_sha256(path) != sha:
            check.problems.append(f"source file {path} changed since the import")
    one_filter = len(info.get("filters_in_file") or []) == 1
    if info.get("tool") == lm_eval_import.TOOL and one_filter and info.get("source_task_hash"):
        if lm_eval_import.task_hash(records) != info["source_task_hash"]:
            check.problems.append("lm-eval's task hash re-computed from the records differs from its results file")
