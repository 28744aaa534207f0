"""`compare_runs()`: the whole `evalpipe compare` workflow as one function, called by the CLI and by `evalpipe ab`.

Load two run folders (or two bench folders), refuse a pair that did not ask the same questions the same way (or is
partial) unless `force`, which compare.json then records, analyse it, and write compare.json (everything) and
report.html (a view of it) into one folder. Printing is the caller's: `report.print_terminal(result)`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from evalpipe.compare import report, stats
from evalpipe.compare.analysis import analyse
from evalpipe.compare.bench_compare import bench_problems, compare_benches, is_bench_folder, load_bench
from evalpipe.compare.runfolder import RunFolderError, comparability_problems, load_run
from evalpipe.harness import acceptance
from evalpipe.harness.records import AB_FILE, MalformedFile, read_json_object
from evalpipe.volatile import SPECULATION_WORDS


class MixedFolders(RunFolderError):
    """One folder is a bench folder and the other a run folder."""


class NotComparable(Exception):
    """The two folders did not ask the same questions the same way; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            "refusing to compare:\n  - " + "\n  - ".join(problems) + "\n(use --force to compare anyway; it is recorded)"
        )


@dataclass
class Comparison:
    result: dict  # compare.json
    json_path: Path
    html_path: Optional[Path]


def default_out(a: str | Path, b: str | Path) -> Path:
    """Beside the inputs: `<their common folder>/compare/<A>__vs__<B>` (results/gsm8k/compare/... for two gsm8k
    runs), whatever the current directory; B's folder when the two share nothing but the root."""

    def tag(p: Path) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "-", p.name) or "run"

    pa, pb = Path(a).resolve(), Path(b).resolve()
    parent = Path(os.path.commonpath([pa.parent, pb.parent]))
    if parent == Path(parent.anchor):
        parent = pb.parent
    return parent / "compare" / f"{tag(pa)}__vs__{tag(pb)}"


def declared_patterns(declared: Iterable[str]) -> list[str]:
    """`--intended` globs for the flags that differ between two arms of an `evalpipe ab` plan: each flag's name, and
    every speculation setting when one of them is a speculation flag (the server derives more from it)."""
    declared = list(declared)
    patterns = [f"*{name}*" for name in declared]
    if any(any(word in name for word in SPECULATION_WORDS) for name in declared):
        patterns += [f"*{word}*" for word in SPECULATION_WORDS]
    return patterns


def ab_plan(run_a: str | Path, run_b: str | Path) -> Optional[tuple[Path, dict]]:
    """(ab.json, its contents) of the `evalpipe ab` plan whose arms made both run folders, else None."""
    a, b = Path(run_a).resolve(), Path(run_b).resolve()
    folder = Path(os.path.commonpath([a, b]))
    for candidate in [folder, *folder.parents][:6]:
        index_path = candidate / AB_FILE
        if not index_path.is_file():
            continue
        try:
            index = read_json_object(index_path)
        except MalformedFile:
            return None
        runs = {
            (candidate / run).resolve()
            for arm in index.get("arms") or []
            if isinstance(arm, dict)
            for run in (arm.get("runs") or {}).values()
            if isinstance(run, str)
        }
        return (index_path, index) if {a, b} <= runs else None
    return None


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    *,
    out: Optional[str | Path] = None,
    margin_pts: float = 1.0,
    force: bool = False,
    intended: Iterable[str] = (),
    seed: int = stats.DEFAULT_SEED,
    n_resamples: int = stats.DEFAULT_RESAMPLES,
    html: bool = True,
    accept_baseline: Optional[dict] = None,
    accept_rtol: float = 0.05,
) -> Comparison:
    """Compare RUN_A (reference) with RUN_B (candidate), every difference B - A; write compare.json (+ report.html).

    Raises RunFolderError (unreadable folder; MixedFolders for a bench folder beside a run folder) and
    NotComparable (unless `force`). With `accept_baseline` (harness/acceptance.py), B's per-position acceptance is
    checked against it at relative tolerance `accept_rtol`."""
    intended = list(intended)
    bench_a, bench_b = is_bench_folder(run_a), is_bench_folder(run_b)
    if bench_a != bench_b:
        raise MixedFolders("one folder is a bench folder (bench.json) and the other is not; compare like with like.")
    if bench_a:
        a, b = load_bench(run_a), load_bench(run_b)
        problems = bench_problems(a, b)
    else:
        a, b = load_run(run_a), load_run(run_b)
        problems = comparability_problems(a, b)
    if problems and not force:
        raise NotComparable(problems)
    plan = None if bench_a or intended else ab_plan(run_a, run_b)
    if plan is not None:  # two arms of one A/B: the flags it declared are the intended difference
        intended = declared_patterns(plan[1].get("declared_flags") or [])
    if bench_a:
        result = compare_benches(a, b, seed=seed, n_resamples=n_resamples, forced=problems)
    else:
        result = analyse(
            a, b, margin_pts=margin_pts, seed=seed, n_resamples=n_resamples, intended=intended, forced=problems
        )
        if plan is not None:
            flags = ", ".join(plan[1].get("declared_flags") or []) or "none"
            result["manifest_diff"]["intended_implied"] = (
                f"both folders come from one `evalpipe ab` plan ({plan[0]}): its declared flags ({flags}) mark the "
                "intended difference"
            )
        result["acceptance"] = {
            "a": acceptance.profile(a.records, (a.summary or {}).get("spec_metrics")),
            "b": acceptance.profile(b.records, (b.summary or {}).get("spec_metrics")),
        }
        if accept_baseline is not None:
            result["accept_baseline"] = acceptance.check_baseline(
                result["acceptance"]["b"], accept_baseline, accept_rtol
            )
    folder = Path(out) if out else default_out(run_a, run_b)
    folder.mkdir(parents=True, exist_ok=True)
    result["command"] = {
        "run_a": str(run_a),
        "run_b": str(run_b),
        "margin_pts": margin_pts,
        "force": force,
        "intended": intended,
        "seed": seed,
        "resamples": n_resamples,
    }
    json_path = report.write_json(result, folder)
    return Comparison(result, json_path, report.write_html(result, folder) if html else None)
