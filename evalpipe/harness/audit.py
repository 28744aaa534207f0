"""Re-check a run folder from its raw records: nothing in summary.json is taken on trust.

Checks, each reported as OK / FAIL with the differing items:
  records     every line is valid JSON with all required keys, run/arm/lane match the manifest
  prompts     every prompt is rebuilt from the dataset; its sha256 matches the record and the body as sent
  grades      every record is re-graded from response_text + finish_reason; answer, verdict, status agree
  complete    every planned (question, repeat) has exactly one record; none unplanned (a partial run fails here)
  summary     summary.json equals a summary recomputed from the records; run-level /metrics figures follow from
              the two snapshots recorded with them
  manifest    start and end snapshots agree on the protocol; dataset / prompt-stream hashes match the pins
A change of our own source tree during the run is printed as a warning, not a failure.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from evalpipe.digest import file_sha256
from evalpipe.harness import manifest as manifest_mod
from evalpipe.harness.records import (
    MANIFEST_FILE,
    RESPONSES_FILE,
    SUMMARY_FILE,
    Record,
    missing_keys,
    read_records,
    record_key,
)
from evalpipe.harness.summary import OMITTED_WHEN_FALSY, RECOMPUTABLE_KEYS, close_values, compute_summary
from evalpipe.lanes import Item, Lane, get_lane, item_groups, load_pins, prompt_sha256, prompt_stream_sha256
from evalpipe.lanes.data import DataError, recorded_data_dir
from evalpipe.lanes.grading import grade_text, grader_pool

MAX_SHOWN = 20


@dataclass
class Check:
    name: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class AuditReport:
    run_dir: Path
    checks: list[Check]
    warnings: list[str]
    recomputed: Optional[dict] = None  # the summary rebuilt from the records (what `summary` compares)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def _load_json(path: Path, check: Check) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        check.problems.append(f"{path.name} is missing")
    except ValueError as exc:
        check.problems.append(f"{path.name} is not valid JSON: {exc}")
    return None


@dataclass
class _Run:
    """What the checks share: the folder, its manifest and summary, the snapshot the run started from."""

    run_dir: Path
    man: dict
    summ: Optional[dict]
    lane: Lane
    start: dict  # the resume's start snapshot when the run was resumed, else the run's
    eff: dict  # start["lane"]["effective"]


def audit_run(
    run_dir: Path,
    data_dir: Optional[Path] = None,
    grader_timeout_s: Optional[float] = None,
    grader_workers: int = 2,
    progress: bool = False,
) -> AuditReport:
    """Every check of the module docstring, in that order, on one run folder."""
    run_dir = Path(run_dir)
    checks = [Check(n) for n in ("records", "prompts", "grades", "complete", "summary", "manifest")]
    c_rec, c_prompt, c_grade, c_done, c_sum, c_man = checks
    warnings: list[str] = []
    man = _load_json(run_dir / MANIFEST_FILE, c_man)
    summ = _load_json(run_dir / SUMMARY_FILE, c_sum)
    if man is None:
        return AuditReport(run_dir, checks, warnings)
    if isinstance(man.get("imported"), dict):  # made by `evalpipe import`: checked for what its source recorded
        from evalpipe.harness.imports.check import audit_imported

        again = audit_imported(
            run_dir, man, summ, {c.name: c for c in checks}, warnings, _regrade, grader_workers, progress
        )
        return AuditReport(run_dir, checks, warnings, again)
    try:
        lane = get_lane(man["lane"])
        start = man.get("resume_start") or man["start"]
        eff = start["lane"]["effective"]
        start["dataset"]["path"], start["prompts"]["prompt_stream_sha256_selected"]
    except (KeyError, TypeError) as exc:
        c_man.problems.append(
            f"manifest.json lacks the run's start snapshot ({type(exc).__name__}: {exc}); nothing to check against"
        )
        return AuditReport(run_dir, checks, warnings)
    run = _Run(run_dir, man, summ, lane, start, eff)
    records = check_records(run, c_rec)
    items = check_prompts(run, records, data_dir, c_prompt)
    check_grades(run, records, grader_timeout_s, grader_workers, progress, c_grade)
    check_complete(run, records, items, c_done)
    again = check_summary(run, records, items, c_sum)
    check_manifest(run, c_man, warnings)
    return AuditReport(run_dir, checks, warnings, again)


def check_records(run: _Run, check: Check) -> list[Record]:
    """responses.jsonl is whole, unchanged since the run pinned its sha256, and every record has every key and
    names this run; returns the records that have every key, as Records (the later checks read only those). The
    raw objects are checked here, so a bad line or a missing key is named by its number."""
    path = run.run_dir / RESPONSES_FILE
    read = read_records(path)
    if not path.exists():
        check.problems.append("responses.jsonl is missing")
    if read.torn_tail:
        check.problems.append("the last line of responses.jsonl is cut off")
    if read.bad_lines:
        check.problems.append(f"lines not valid JSON objects: {read.bad_lines[:MAX_SHOWN]}")
    pinned = run.man.get("responses_sha256")
    if pinned is not None and path.exists():
        now = file_sha256(path)
        if now != pinned:
            check.problems.append(
                f"responses.jsonl changed after the run finished: sha256 {now[:16]}..., "
                f"manifest.json recorded {pinned[:16]}..."
            )
    # the server's deterministic mode each record carries is one its run's snapshots recorded (start, resume)
    snapshots = [run.man[k] for k in ("start", "resume_start") if isinstance(run.man.get(k), dict)]
    modes = [(snap.get("server") or {}).get("deterministic") for snap in snapshots]
    for i, r in enumerate(read.records):
        miss = missing_keys(r)
        if miss:
            check.problems.append(f"record {i + 1}: missing keys {miss}")
        for k in ("run_id", "arm", "lane"):
            if r.get(k) != run.man.get(k):
                check.problems.append(f"record {i + 1}: {k}={r.get(k)!r}, manifest says {run.man.get(k)!r}")
        if "server_deterministic" in r and r["server_deterministic"] not in modes:
            check.problems.append(
                f"record {i + 1}: server_deterministic={r['server_deterministic']!r}, the manifest's server "
                f"snapshots say {' or '.join(map(repr, modes))}"
            )
    return [Record.from_json(r) for r in read.records if not missing_keys(r)]


def check_prompts(run: _Run, records: list[Record], data_dir: Optional[Path], check: Check) -> list[Item]:
    """Rebuild the selected items from the dataset; each record's prompt hash, body and gold answer must match.
    Returns the selected items (empty when the data cannot be loaded)."""
    start, lane = run.start, run.lane
    try:
        if data_dir is None:
            data_dir = recorded_data_dir(start["dataset"]["path"])
        data = lane.load(data_dir, allow_data_drift=True)
    except DataError as exc:
        check.problems.append(f"cannot rebuild prompts: {exc}")
        return []
    if data.dataset_sha256 != start["dataset"]["sha256"]:
        check.problems.append(f"dataset sha256 now {data.dataset_sha256}, run used {start['dataset']['sha256']}")
    items = data.items[: run.eff["num_examples"]] if run.eff.get("num_examples") else data.items
    by_id = {it.question_id: it for it in items}
    selected_stream = prompt_stream_sha256([it.prompt_sha256 for it in items])
    if selected_stream != start["prompts"]["prompt_stream_sha256_selected"]:
        check.problems.append("prompt stream of the selected items differs from the manifest")
    for r in records:
        it = by_id.get(r.question_id)
        if it is None:
            continue  # reported by `complete`
        where = f"{r.question_id}/{r.repeat_index}"
        sent = r.request.get("prompt") if lane.api == "completions" else r.request.get("messages")
        if r.prompt_sha256 != it.prompt_sha256:
            check.problems.append(f"{where}: prompt_sha256 differs from the rebuilt prompt")
        elif sent is None or prompt_sha256(sent) != it.prompt_sha256:
            check.problems.append(f"{where}: the request body's prompt is not the rebuilt prompt")
        if r.expected_answer != it.expected_answer:
            check.problems.append(
                f"{r.question_id}: expected_answer {r.expected_answer!r} != gold {it.expected_answer!r}"
            )
    return items


def check_grades(
    run: _Run, records: list[Record], grader_timeout_s: Optional[float], workers: int, progress: bool, check: Check
) -> None:
    """Re-grade every record from its text and finish reason; answer, verdict, status and truncated flag agree."""
    timeout = grader_timeout_s or run.start.get("transport", {}).get("grader_timeout_s") or 30.0
    regraded = _regrade(run.lane.grader, records, timeout, workers, progress)
    for r, (extracted, correct, status) in zip(records, regraded):
        where = f"{r.question_id}/{r.repeat_index}"
        got = (None, False, "request_error") if r.error else (extracted, correct, status)
        want = (r.extracted_answer, r.correct, r.grade_status)
        if got != want:
            check.problems.append(f"{where}: recorded {want}, re-graded {got}")
        if r.truncated != (r.finish_reason == "length"):
            check.problems.append(f"{where}: truncated flag disagrees with finish_reason")


def check_complete(run: _Run, records: list[Record], items: list[Item], check: Check) -> None:
    """Every planned (question, repeat) has exactly one record, and no record is outside the plan."""
    planned = [(run.lane.name, it.question_id, k) for it in items for k in range(run.eff["repeats"])]
    seen: dict = {}
    for r in records:
        seen[record_key(r)] = seen.get(record_key(r), 0) + 1
    dups = [k for k, n in seen.items() if n > 1]
    missing = [k for k in planned if k not in seen]
    unplanned = [k for k in seen if k not in set(planned)]
    if dups:
        check.problems.append(f"{len(dups)} keys have more than one record, e.g. {dups[:MAX_SHOWN]}")
    if missing:
        check.problems.append(
            f"{len(missing)} of {len(planned)} planned responses have no record"
            + (" (the run is partial)" if run.summ and run.summ.get("partial") else "")
            + f", e.g. {missing[:5]}"
        )
    if unplanned:
        check.problems.append(f"{len(unplanned)} records are not in the plan, e.g. {unplanned[:5]}")


def check_summary(run: _Run, records: list[Record], items: list[Item], check: Check) -> Optional[dict]:
    """summary.json equals the summary recomputed from the records (returned; None without a summary.json), and
    its run-level /metrics figures follow from their two snapshots."""
    summ, lane = run.summ, run.lane
    if summ is None:
        return None
    meta = {k: summ.get(k) for k in ("arm", "run_id", "model", "endpoint")}
    again = compute_summary(
        lane_name=lane.name,
        grader=lane.grader,
        repeats=run.eff["repeats"],
        planned_question_ids=[it.question_id for it in items],
        records=records,
        meta=meta,
        groups=item_groups(items),
    )
    keys = [
        k
        for k in RECOMPUTABLE_KEYS
        if (k in again or k in summ) and not (k in OMITTED_WHEN_FALSY and k not in summ and not again.get(k))
    ]
    keys += [k for k in again if k.startswith(("pass@", "majority@")) or k == "no_answer"]
    for k in keys:
        if not close_values(summ.get(k), again.get(k)):
            if k == "accuracy" and summ.get("refused"):
                continue
            check.problems.append(f"{k}: summary.json says {summ.get(k)!r}, records give {again.get(k)!r}")
    check.problems.extend(_spec_metrics_problems(summ.get("spec_metrics")))
    return again


def check_manifest(run: _Run, check: Check, warnings: list[str]) -> None:
    """Start, resume and end snapshots agree on the protocol; the data hashes match the lane's pins (a warning
    when the run allowed drift); the dataset file, where present, is the one the run read."""
    man, start, summ = run.man, run.start, run.summ
    if man.get("end") is None:
        check.problems.append("no end snapshot (the run did not finish writing its manifest)")
    else:
        protocol, code = manifest_mod.differences(start, man["end"])
        if protocol:
            check.problems.extend(f"changed during the run: {d}" for d in protocol)
        warnings.extend(f"source changed during the run: {d}" for d in code)
        if bool(protocol) != bool(summ and summ.get("manifest_changed")):
            check.problems.append("summary.manifest_changed does not match the manifest snapshots")
    if "start" in man and man.get("resume_start"):
        protocol, _ = manifest_mod.differences(man["start"], man["resume_start"])
        check.problems.extend(f"changed between start and resume: {d}" for d in protocol)
    try:
        pins = load_pins(run.lane.name)
        allp = start["dataset"]["all_items"]
        drift_allowed = start["dataset"].get("allow_data_drift")
        for k in ("dataset_sha256", "id_list_sha256", "template_sha256", "prompt_stream_sha256"):
            if allp.get(k) != pins.get(k):
                msg = f"{k}: run {allp.get(k)}, pin {pins.get(k)}"
                (warnings if drift_allowed else check.problems).append(
                    msg + (" (run allowed data drift)" if drift_allowed else "")
                )
    except FileNotFoundError as exc:
        check.problems.append(str(exc))
    try:
        if file_sha256(Path(start["dataset"]["path"])) != start["dataset"]["sha256"]:
            check.problems.append("the dataset file changed since the run")
    except OSError:
        check.notes.append(f"dataset file {start['dataset']['path']} not present here; rebuilt from the data dir")


def _spec_metrics_problems(block: Any) -> list[str]:
    """The run-level speculative figures must follow from the two /metrics snapshots recorded beside them."""
    if not isinstance(block, dict) or "after" not in block:
        return []
    from evalpipe.harness.spec_metrics import run_level

    again = run_level(block.get("before"), block.get("after")) or {}
    return [
        f"spec_metrics.{k}: summary.json says {block.get(k)!r}, its /metrics snapshots give {again.get(k)!r}"
        for k in sorted(set(again) - {"before", "after", "covers"})
        if not close_values(block.get(k), again.get(k))
    ]


def _regrade(grader: str, records: list[Record], timeout_s: float, workers: int, progress: bool = False) -> list[tuple]:
    """Grades of `records` from their raw text, in order; `progress` shows a bar on stderr (the AIME grader can
    take seconds per answer)."""
    pool = grader_pool(grader, workers, timeout_s) if any(not r.error for r in records) else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=len(records),
            desc="audit: re-grading",
            unit="rec",
            file=sys.stderr,
            mininterval=0.5,
            dynamic_ncols=True,
        )

    async def go():
        sem = asyncio.Semaphore(max(1, workers) * 2)

        async def one(r):
            try:
                if r.error:
                    return (None, False, "request_error")
                async with sem:
                    return await grade_text(
                        grader,
                        r.expected_answer,
                        r.response_text or "",
                        r.finish_reason == "length",
                        pool,
                    )
            finally:
                if bar is not None:
                    bar.update(1)

        return await asyncio.gather(*(one(r) for r in records))

    try:
        return list(asyncio.run(go()))
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.close()
