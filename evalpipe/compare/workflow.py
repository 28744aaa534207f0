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


class MixedFolders(RunFolderError):
    """One folder is a bench folder and the other a run folder."""


class NotComparable(Exception):
    """The two folders did not ask the same questions the same way; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("refusing to compare:\n  - " + "\n  - ".join(problems)
                         + "\n(use --force to compare anyway; it is recorded)")


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


def compare_runs(run_a: str | Path, run_b: str | Path, *, out: Optional[str | Path] = None, margin_pts: float = 1.0,
                 force: bool = False, intended: Iterable[str] = (), seed: int = stats.DEFAULT_SEED,
                 n_resamples: int = stats.DEFAULT_RESAMPLES, html: bool = True,
                 accept_baseline: Optional[dict] = None, accept_rtol: float = 0.05) -> Comparison:
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
    if bench_a:
        result = compare_benches(a, b, seed=seed, n_resamples=n_resamples, forced=problems)
    else:
        result = analyse(a, b, margin_pts=margin_pts, seed=seed, n_resamples=n_resamples, intended=intended,
                         forced=problems)
        result["acceptance"] = {"a": acceptance.profile(a.records, (a.summary or {}).get("spec_metrics")),
                                "b": acceptance.profile(b.records, (b.summary or {}).get("spec_metrics"))}
        if accept_baseline is not None:
            result["accept_baseline"] = acceptance.check_baseline(result["acceptance"]["b"], accept_baseline,
                                                                  accept_rtol)
    folder = Path(out) if out else default_out(run_a, run_b)
    folder.mkdir(parents=True, exist_ok=True)
    result["command"] = {"run_a": str(run_a), "run_b": str(run_b), "margin_pts": margin_pts, "force": force,
                         "intended": intended, "seed": seed, "resamples": n_resamples}
    json_path = report.write_json(result, folder)
    return Comparison(result, json_path, report.write_html(result, folder) if html else None)
