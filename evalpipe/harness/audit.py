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

from evalpipe.harness import manifest as manifest_mod
from evalpipe.harness.records import MANIFEST_FILE, RESPONSES_FILE, SUMMARY_FILE, missing_keys, read_records, record_key
from evalpipe.harness.summary import KEYS_ADDED_LATER, RECOMPUTABLE_KEYS, close_values, compute_summary
from evalpipe.lanes import get_lane, item_groups, load_pins, prompt_sha256, prompt_stream_sha256
from evalpipe.digest import file_sha256
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


def audit_run(run_dir: Path, data_dir: Optional[Path] = None, grader_timeout_s: Optional[float] = None,
              grader_workers: int = 2, progress: bool = False) -> AuditReport:
    run_dir = Path(run_dir)
    c_rec, c_prompt, c_grade, c_done, c_sum, c_man = (Check(n) for n in
                                                      ("records", "prompts", "grades", "complete", "summary", "manifest"))
    checks = [c_rec, c_prompt, c_grade, c_done, c_sum, c_man]
    warnings: list[str] = []
    man = _load_json(run_dir / MANIFEST_FILE, c_man)
    summ = _load_json(run_dir / SUMMARY_FILE, c_sum)
    if man is None:
        return AuditReport(run_dir, checks, warnings)
    if isinstance(man.get("imported"), dict):  # made by `evalpipe import`: checked for what its source recorded
        from evalpipe.harness.imports.check import audit_imported

        again = audit_imported(run_dir, man, summ, {c.name: c for c in checks}, warnings, _regrade, grader_workers,
                               progress)
        return AuditReport(run_dir, checks, warnings, again)
    try:
        lane = get_lane(man["lane"])
        start = man.get("resume_start") or man["start"]
        eff = start["lane"]["effective"]
        start["dataset"]["path"], start["prompts"]["prompt_stream_sha256_selected"]
    except (KeyError, TypeError) as exc:
        c_man.problems.append(f"manifest.json lacks the run's start snapshot ({type(exc).__name__}: {exc}); nothing to check against")
        return AuditReport(run_dir, checks, warnings)

    # ---- records
    read = read_records(run_dir / RESPONSES_FILE)
    if not (run_dir / RESPONSES_FILE).exists():
        c_rec.problems.append("responses.jsonl is missing")
    if read.torn_tail:
        c_rec.problems.append("the last line of responses.jsonl is cut off")
    if read.bad_lines:
        c_rec.problems.append(f"lines not valid JSON objects: {read.bad_lines[:MAX_SHOWN]}")
    pinned = man.get("responses_sha256")
    if pinned is not None and (run_dir / RESPONSES_FILE).exists():
        now = file_sha256(run_dir / RESPONSES_FILE)
        if now != pinned:
            c_rec.problems.append(f"responses.jsonl changed after the run finished: sha256 {now[:16]}..., "
                                  f"manifest.json recorded {pinned[:16]}...")
    records = read.records
    for i, r in enumerate(records):
        miss = missing_keys(r)
        if miss:
            c_rec.problems.append(f"record {i + 1}: missing keys {miss}")
        for k in ("run_id", "arm", "lane"):
            if r.get(k) != man.get(k):
                c_rec.problems.append(f"record {i + 1}: {k}={r.get(k)!r}, manifest says {man.get(k)!r}")
    records = [r for r in records if not missing_keys(r)]

    # ---- prompts
    try:
        if data_dir is None:
            data_dir = recorded_data_dir(start["dataset"]["path"])
        data = lane.load(data_dir, allow_data_drift=True)
    except DataError as exc:
        c_prompt.problems.append(f"cannot rebuild prompts: {exc}")
        data = None
    if data is not None:
        if data.dataset_sha256 != start["dataset"]["sha256"]:
            c_prompt.problems.append(f"dataset sha256 now {data.dataset_sha256}, run used {start['dataset']['sha256']}")
        items = data.items[: eff["num_examples"]] if eff.get("num_examples") else data.items
        by_id = {it.question_id: it for it in items}
        selected_stream = prompt_stream_sha256([it.prompt_sha256 for it in items])
        if selected_stream != start["prompts"]["prompt_stream_sha256_selected"]:
            c_prompt.problems.append("prompt stream of the selected items differs from the manifest")
        for r in records:
            it = by_id.get(r["question_id"])
            if it is None:
                continue  # reported by `complete`
            sent = r["request"].get("prompt") if lane.api == "completions" else r["request"].get("messages")
            if r["prompt_sha256"] != it.prompt_sha256:
                c_prompt.problems.append(f"{r['question_id']}/{r['repeat_index']}: prompt_sha256 differs from the rebuilt prompt")
            elif sent is None or prompt_sha256(sent) != it.prompt_sha256:
                c_prompt.problems.append(f"{r['question_id']}/{r['repeat_index']}: the request body's prompt is not the rebuilt prompt")
            if r["expected_answer"] != it.expected_answer:
                c_prompt.problems.append(f"{r['question_id']}: expected_answer {r['expected_answer']!r} != gold {it.expected_answer!r}")
    else:
        items = []

    # ---- grades
    timeout = grader_timeout_s or start.get("transport", {}).get("grader_timeout_s") or 30.0
    regraded = _regrade(lane.grader, records, timeout, grader_workers, progress)
    for r, (extracted, correct, status) in zip(records, regraded):
        if r.get("error"):
            got = (None, False, "request_error")
        else:
            got = (extracted, correct, status)
        want = (r["extracted_answer"], r["correct"], r["grade_status"])
        if got != want:
            c_grade.problems.append(f"{r['question_id']}/{r['repeat_index']}: recorded {want}, re-graded {got}")
        if r["truncated"] != (r["finish_reason"] == "length"):
            c_grade.problems.append(f"{r['question_id']}/{r['repeat_index']}: truncated flag disagrees with finish_reason")

    # ---- completeness
    repeats = eff["repeats"]
    planned = [(lane.name, it.question_id, k) for it in items for k in range(repeats)]
    seen: dict = {}
    for r in records:
        seen[record_key(r)] = seen.get(record_key(r), 0) + 1
    dups = [k for k, n in seen.items() if n > 1]
    missing = [k for k in planned if k not in seen]
    unplanned = [k for k in seen if k not in set(planned)]
    if dups:
        c_done.problems.append(f"{len(dups)} keys have more than one record, e.g. {dups[:MAX_SHOWN]}")
    if missing:
        c_done.problems.append(f"{len(missing)} of {len(planned)} planned responses have no record"
                               + (" (the run is partial)" if summ and summ.get("partial") else "")
                               + f", e.g. {missing[:5]}")
    if unplanned:
        c_done.problems.append(f"{len(unplanned)} records are not in the plan, e.g. {unplanned[:5]}")

    # ---- summary
    again = None
    if summ is not None:
        meta = {k: summ.get(k) for k in ("arm", "run_id", "model", "endpoint")}
        again = compute_summary(lane_name=lane.name, grader=lane.grader, repeats=repeats,
                                planned_question_ids=[it.question_id for it in items], records=records, meta=meta,
                                groups=item_groups(items))
        keys = [k for k in RECOMPUTABLE_KEYS if (k in again or k in summ)
                and not (k in KEYS_ADDED_LATER and k not in summ and not again.get(k))]
        keys += [k for k in again if k.startswith(("pass@", "majority@")) or k == "no_answer"]
        for k in keys:
            if not close_values(summ.get(k), again.get(k)):
                if k == "accuracy" and summ.get("refused"):
                    continue
                c_sum.problems.append(f"{k}: summary.json says {summ.get(k)!r}, records give {again.get(k)!r}")
        c_sum.problems.extend(_spec_metrics_problems(summ.get("spec_metrics")))

    # ---- manifest
    if man.get("end") is None:
        c_man.problems.append("no end snapshot (the run did not finish writing its manifest)")
    else:
        protocol, code = manifest_mod.differences(start, man["end"])
        if protocol:
            c_man.problems.extend(f"changed during the run: {d}" for d in protocol)
        warnings.extend(f"source changed during the run: {d}" for d in code)
        if bool(protocol) != bool(summ and summ.get("manifest_changed")):
            c_man.problems.append("summary.manifest_changed does not match the manifest snapshots")
    if "start" in man and man.get("resume_start"):
        protocol, _ = manifest_mod.differences(man["start"], man["resume_start"])
        c_man.problems.extend(f"changed between start and resume: {d}" for d in protocol)
    try:
        pins = load_pins(lane.name)
        allp = start["dataset"]["all_items"]
        for k in ("dataset_sha256", "id_list_sha256", "template_sha256", "prompt_stream_sha256"):
            if allp.get(k) != pins.get(k):
                msg = f"{k}: run {allp.get(k)}, pin {pins.get(k)}"
                (warnings if start["dataset"].get("allow_data_drift") else c_man.problems).append(
                    msg + (" (run allowed data drift)" if start["dataset"].get("allow_data_drift") else ""))
    except FileNotFoundError as exc:
        c_man.problems.append(str(exc))
    try:
        if file_sha256(Path(start["dataset"]["path"])) != start["dataset"]["sha256"]:
            c_man.problems.append("the dataset file changed since the run")
    except OSError:
        c_man.notes.append(f"dataset file {start['dataset']['path']} not present here; rebuilt from the data dir")
    return AuditReport(run_dir, checks, warnings, again)


def _spec_metrics_problems(block: Any) -> list[str]:
    """The run-level speculative figures must follow from the two /metrics snapshots recorded beside them."""
    if not isinstance(block, dict) or "after" not in block:
        return []
    from evalpipe.harness.spec_metrics import run_level

    again = run_level(block.get("before"), block.get("after")) or {}
    return [f"spec_metrics.{k}: summary.json says {block.get(k)!r}, its /metrics snapshots give {again.get(k)!r}"
            for k in sorted(set(again) - {"before", "after", "covers"}) if not close_values(block.get(k), again.get(k))]


def _regrade(grader: str, records: list[dict], timeout_s: float, workers: int, progress: bool = False) -> list[tuple]:
    """Grades of `records` from their raw text, in order; `progress` shows a bar on stderr (the AIME grader can
    take seconds per answer)."""
    pool = grader_pool(grader, workers, timeout_s) if any(not r.get("error") for r in records) else None
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(records), desc="audit: re-grading", unit="rec", file=sys.stderr, mininterval=0.5,
                   dynamic_ncols=True)

    async def go():
        sem = asyncio.Semaphore(max(1, workers) * 2)

        async def one(r):
            try:
                if r.get("error"):
                    return (None, False, "request_error")
                async with sem:
                    return await grade_text(grader, r["expected_answer"], r.get("response_text") or "",
                                            r.get("finish_reason") == "length", pool)
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
