"""The A/B sequence behind `evalpipe ab`: boot, check receipts, run lanes, stop; then compare and report.

Kept apart from the click command so that the order of events (and what is written when something fails) is
readable in one place. Every boot goes through a launcher and is stopped in a `finally`, so an error or Ctrl-C
never leaves a server running; `ab.json` is rewritten after every step, so a failed A/B still says how far it got.
"""

from __future__ import annotations

import dataclasses
import signal
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import click

from evalpipe.ab.arms import TIE_THRESHOLD, arm_labels, comparison_pairs
from evalpipe.ab.report import write_report
from evalpipe.compare.analysis import arm_accept_length
from evalpipe.compare.gate import GATE_FAILED_EXIT, verdict_of
from evalpipe.compare.report import print_terminal, verdict_summary
from evalpipe.compare.runfolder import RunFolderError, load_run
from evalpipe.compare.workflow import NotComparable, compare_runs, declared_patterns
from evalpipe.console import make_console
from evalpipe.harness import spec_metrics
from evalpipe.harness.agreement import compare_outputs
from evalpipe.harness.client import Server
from evalpipe.harness.lane_run import LaneRun, RunConfig, RunError
from evalpipe.harness.records import AB_FILE
from evalpipe.harness.server_facts import determinism_note, deterministic_label
from evalpipe.lanes import get_lane
from evalpipe.launchers import LaunchOptions, ServerStartError, make_launcher
from evalpipe.launchers.base import free_port
from evalpipe.launchers.launch import boot, finish
from evalpipe.launchers.receipts import receipt_differences, write_receipt
from evalpipe.redact import redact

INDEX_FILE = AB_FILE
GREEDY_SUMMARY_BLOCKS = ("interval", "planning_discordance", "output_identity")  # the verdict's own figures
REPORT_FILE = "report.html"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _pts(x) -> str:
    return "n/a" if x is None else f"{x:.2f} pt"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class ABRun:
    out: Path
    lanes: list[str]
    options: dict[str, LaunchOptions]
    port_given: dict[str, bool]
    args: dict[str, str]
    order: str
    declared: list[str]
    allow: list[str] = field(default_factory=list)
    ready_timeout: float = 900.0
    num_examples: int | None = None
    max_tokens: int | None = None
    concurrency: int | None = None
    logprobs: int | None = 2
    tie_threshold: float = TIE_THRESHOLD
    margin: float = 1.0
    fail_on: frozenset = frozenset()
    data_dir: Path | None = None
    command_line: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.labels = arm_labels(self.order)
        self.index: dict = {
            "schema": 1,
            "status": "running",
            "started_at": _now(),
            "finished_at": None,
            "command": self.command_line,
            "lanes": self.lanes,
            "order": self.order,
            "args": self.args,
            "declared_flags": self.declared,
            "allow_diff": self.allow,
            "protocol": {
                "num_examples": self.num_examples,
                "max_tokens": self.max_tokens,
                "concurrency": self.concurrency,
                "logprobs": self.logprobs,
            },
            "tie_rule": (
                f"a differing greedy output is a numerical tie when, at the first differing token, the logprob gap "
                f"between the two arms' choices is below {self.tie_threshold:g} (needs recorded logprobs)"
            ),
            "arms": [],
            "receipt_checks": [],
            "comparisons": [],
            "warnings": [],
            "error": None,
            "lossy_acceptance": {side: self.options[side].lossy_acceptance for side in ("A", "B")},
            "fail_on": sorted(self.fail_on),
        }
        for side in ("A", "B"):
            if self.options[side].lossy_acceptance:
                self.index["warnings"].append(
                    f"arm {side} asks for LOSSY acceptance {self.options[side].lossy_acceptance}: it accepts drafts "
                    "the target did not choose, so its accuracy measures that rule (on purpose)"
                )

    # ----- bookkeeping ----------------------------------------------------------------------------------
    def save(self) -> None:
        """ab.json and report.html, secrets redacted (the arm arguments and the command line may carry a key)."""
        index = redact(self.index, [o.api_key or "" for o in self.options.values()])
        write_receipt(self.out / INDEX_FILE, index)  # atomic JSON write (same as receipts)
        write_report(self.out, index)

    def fail(self, message: str, status: str = "failed") -> int:
        self.index.update(status=status, error=message, finished_at=_now())
        self.save()
        click.echo(f"evalpipe ab: {message}", err=True)
        return 130 if status == "interrupted" else 1

    # ----- the sequence ---------------------------------------------------------------------------------
    def execute(self, preflight: bool = False) -> int:
        labels = self.labels
        if preflight:
            labels = [("A", "A1"), ("B", "B1")]
            self.index["preflight"] = True
        receipts: dict[str, dict] = {}
        first_of: dict[str, str] = {}
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            for side, label in labels:
                arm = {
                    "label": label,
                    "side": side,
                    "dir": f"arms/{label}",
                    "receipt": f"arms/{label}/receipt.json",
                    "log": f"arms/{label}/server.log",
                    "runs": {},
                    "status": "booting",
                }
                self.index["arms"].append(arm)
                self.save()
                problem = self.run_arm(side, label, arm, receipts, first_of, run_lanes=not preflight)
                if problem:
                    return self.fail(problem, status="refused" if arm["status"] == "refused" else "failed")
        except KeyboardInterrupt:
            return self.fail("interrupted; every server was stopped", status="interrupted")
        finally:
            signal.signal(signal.SIGTERM, previous)
        if not preflight:
            self.compare_all()
        failed = [c for c in self.index["comparisons"] if c.get("error")]
        self.index.update(status="done" if not failed else "done, comparisons failed", finished_at=_now())
        self.save()
        self.print_summary()
        click.echo(f"report: {self.out / REPORT_FILE}")
        if failed:
            return 1
        return self.gate()

    def gate(self) -> int:
        """GATE_FAILED_EXIT when an A vs B comparison's verdict is one of --fail-on (boot pairs are not gated)."""
        hits = [c for c in self.index["comparisons"] if c["kind"] == "ab" and c.get("verdict") in self.fail_on]
        for c in hits:
            click.echo(
                f"gate: {c['lane']} {c['a']} vs {c['b']} is {c['verdict']}, in --fail-on "
                f"{','.join(sorted(self.fail_on))}: exit {GATE_FAILED_EXIT}",
                err=True,
            )
        return GATE_FAILED_EXIT if hits else 0

    def print_summary(self) -> None:
        """Per comparison: both accuracies, flips with McNemar's p, the verdict, identical outputs, ties and accept
        length, and where its report is."""

        def pct(x):
            return "-" if x is None else f"{100 * x:.2f}%"

        arms = self.index["arms"]
        for a in arms:
            click.echo(f"arm {a['label']}: deterministic {deterministic_label(a.get('deterministic'))}")
        if arms:
            click.echo(determinism_note(a.get("deterministic") for a in arms))
        for c in self.index["comparisons"]:
            if c.get("error"):
                click.echo(f"{c['lane']} {c['a']} vs {c['b']} ({c['kind']}): compare failed: {c['error']}")
                continue
            ties = c.get("ties") or {}
            spec = c.get("spec") or {}
            greedy = c.get("greedy") or {}
            accept = [arm_accept_length(spec.get(k))[0] for k in ("a", "b")]
            flips = (
                f"flips {greedy['a_only']} lost / {greedy['b_only']} gained (McNemar p {greedy['mcnemar_p']:.3g}); "
                f"{verdict_summary(greedy)}; "
                if "interval" in greedy
                else ""
            )
            if c.get("repeated"):
                flips = f"{c['verdict']} at -{c['margin_pts']:g} pt (smallest detectable drop {_pts(c['mde_pts'])}); "
            click.echo(
                f"{c['lane']} {c['a']} vs {c['b']} ({c['kind']}): accuracy {pct(c.get('accuracy_a'))} vs "
                f"{pct(c.get('accuracy_b'))}; {flips}identical outputs {pct(ties.get('agreement'))}, ties "
                f"{ties.get('n_ties')}, real differences {ties.get('n_real_differences')}, undecided "
                f"{ties.get('n_undecided')}; accept length "
                + " vs ".join("off" if x is None else f"{x:.2f}" for x in accept)
                + (f"; report {self.out / c['report']}" if c.get("report") else "")
            )

    def run_arm(self, side, label, arm, receipts, first_of, run_lanes: bool) -> str | None:
        """Boot one arm, check it, run its lanes, stop it. Returns a failure message, or None."""
        options = self.options[side]
        if not self.port_given[side]:
            options = dataclasses.replace(options, port=free_port())
        launcher = make_launcher(options)
        arm_dir = self.out / arm["dir"]
        receipt_path = self.out / arm["receipt"]
        click.echo(f"[{label}] booting {launcher.engine}: {launcher.shell_command()}", err=True)
        try:
            receipt = boot(launcher, receipt_path, self.out / arm["log"], self.ready_timeout)
        except ServerStartError as exc:
            arm["status"] = "boot failed"
            return f"[{label}] {exc}"
        try:
            receipts[label] = receipt
            arm["status"] = "ready"
            arm["deterministic"] = receipt.get("deterministic")
            problems = self.check_receipt(side, label, receipt, receipts, first_of)
            if problems:
                arm["status"] = "refused"
                return (
                    f"[{label}] receipt differs beyond the declared flags {self.declared or '(none)'}:\n  "
                    + "\n  ".join(problems)
                )
            first_of.setdefault(side, label)
            if run_lanes:
                # the arm's speculative counters from /metrics (vLLM, SGLang): run-level, the whole arm
                metrics_before = self.metrics_snapshot(launcher)
                for lane in self.lanes:
                    arm["status"] = f"running {lane}"
                    self.save()
                    run_dir, code, message = self.run_lane(
                        lane, label, launcher, arm_dir / "runs", arm.get("deterministic")
                    )
                    arm["runs"][lane] = str(run_dir.relative_to(self.out)) if run_dir else None
                    if code:
                        arm["status"] = f"{lane} failed"
                        if code in (130, 143):
                            raise KeyboardInterrupt
                        return f"[{label}] lane {lane}: {message}"
                arm["spec_metrics"] = spec_metrics.run_level(metrics_before, self.metrics_snapshot(launcher))
            arm["status"] = "done"
        finally:
            receipt = finish(launcher, receipt_path, receipts.get(label, receipt))
            receipts[label] = receipt
            self.save()
        return None

    @staticmethod
    def metrics_snapshot(launcher) -> dict | None:
        with Server(launcher.base_url, launcher.options.api_key, trust_env=False) as server:  # a server started here
            return spec_metrics.snapshot(server)

    def check_receipt(self, side, label, receipt, receipts, first_of) -> list[str]:
        """Same side: everything equal. Other side: differences only where the declared flags explain them."""
        problems = []
        for other_side, declared in ((side, []), ("B" if side == "A" else "A", self.declared)):
            other = first_of.get(other_side)
            if other is None:
                continue
            found = receipt_differences(receipts[other], receipt, declared=declared, allow=self.allow)
            self.index["receipt_checks"].append(
                {"arm": label, "against": other, "declared": declared, "differences": found, "ok": not found}
            )
            problems += [f"vs {other}: {p}" for p in found]
        return problems

    def run_lane(self, lane: str, label: str, launcher, out: Path, deterministic: bool | None = None):
        """Run one lane in-process through evalpipe's runner; returns (run_dir, exit_code, message).
        `deterministic`: the arm's mode as its receipt says (vLLM reports it only through its launcher)."""
        overrides = {"max_tokens": self.max_tokens} if self.max_tokens is not None else {}
        config = RunConfig(
            lane=get_lane(lane),
            base_url=launcher.base_url + "/v1",
            api_key=launcher.options.api_key,
            arm=label,
            out_dir=out,
            concurrency=self.concurrency,
            overrides=overrides,
            num_examples=self.num_examples,
            data_dir=self.data_dir,
            logprobs=self.logprobs,
            command_line=self.command_line,
            launched_deterministic=deterministic,
        )
        try:
            outcome = LaneRun(config).execute()
        except RunError as exc:
            return None, 1, str(exc)
        finally:
            signal.signal(signal.SIGTERM, _interrupt)  # the runner's event loop restored the default on exit
        return outcome.run_dir, outcome.exit_code, outcome.message

    # ----- comparisons ----------------------------------------------------------------------------------
    def compare_all(self) -> None:
        runs = {arm["label"]: arm["runs"] for arm in self.index["arms"]}
        for lane in self.lanes:
            for kind, x, y in comparison_pairs(self.labels):
                entry = {"lane": lane, "kind": kind, "a": x, "b": y, "dir": f"compare/{lane}/{x}-vs-{y}"}
                self.index["comparisons"].append(entry)
                try:
                    entry.update(self.compare_pair(runs[x][lane], runs[y][lane], self.out / entry["dir"], kind))
                except Exception as exc:  # a failed compare is reported, the others still run
                    entry["error"] = f"{type(exc).__name__}: {exc}"
                    entry["traceback"] = traceback.format_exc(limit=5)
                self.save()
        self.warn_on_idle_speculation()

    def intended_patterns(self, kind: str) -> list[str]:
        return [] if kind == "boot" else declared_patterns(self.declared)

    def compare_pair(self, run_x: str, run_y: str, out: Path, kind: str) -> dict:
        """`compare_runs` on one pair; its table goes to compare.txt (the A/B prints one summary at the end)."""
        try:
            result = compare_runs(
                self.out / run_x,
                self.out / run_y,
                out=out,
                margin_pts=self.margin,
                intended=self.intended_patterns(kind),
            ).result
        except (RunFolderError, NotComparable) as exc:
            return {"error": str(exc)}
        with open(out / "compare.txt", "w", encoding="utf-8") as fh:
            print_terminal(result, make_console(file=fh))
        summary = {
            "report": f"{out.relative_to(self.out)}/report.html",
            "accuracy_a": result.get("accuracy", {}).get("a"),
            "accuracy_b": result.get("accuracy", {}).get("b"),
            "accuracy_diff": result.get("accuracy", {}).get("diff"),
            "greedy": {
                k: v
                for k, v in (result.get("greedy") or {}).items()
                if not isinstance(v, (list, dict)) or k in GREEDY_SUMMARY_BLOCKS
            },
            **verdict_of(result),
            "repeated": {k: (result.get("repeated_stats") or {}).get(k) for k in ("interval", "power")}
            if result.get("repeated_stats")
            else None,
            "agreement": result.get("agreement"),
            "spec": result.get("spec"),
        }
        summary["ties"] = self.tie_analysis(self.out / run_x, self.out / run_y)
        return summary

    def tie_analysis(self, run_x: Path, run_y: Path) -> dict:
        """Classify every non-identical greedy output: numerical tie, real difference, or undecidable."""
        a, b = load_run(run_x), load_run(run_y)
        common = sorted(set(a.by_key) & set(b.by_key), key=str)
        ties, real, undecided = [], [], []
        for key in common:
            result = compare_outputs(a.by_key[key], b.by_key[key])
            if result["identical"]:
                continue
            gap = (result.get("logprob") or {}).get("gap")
            row = {
                "question_id": key[1],
                "repeat_index": key[2],
                "position": result["position"],
                "basis": result["basis"],
                "gap": gap,
            }
            if gap is None:
                undecided.append(row)
            elif abs(gap) < self.tie_threshold:
                ties.append(row)
            else:
                real.append(row)
        n = len(common)
        identical = n - len(ties) - len(real) - len(undecided)
        return {
            "n_pairs": n,
            "n_identical": identical,
            "n_ties": len(ties),
            "n_real_differences": len(real),
            "n_undecided": len(undecided),
            "agreement": identical / n if n else None,
            "agreement_with_ties": (identical + len(ties)) / n if n else None,
            "ties": ties,
            "real_differences": real,
            "undecided": undecided,
        }

    def warn_on_idle_speculation(self) -> None:
        """Accuracy alone hides speculation that never ran: flag a speculative arm whose accept length is <= 1."""
        for side in ("A", "B"):
            if not self.options[side].speculation_on:
                continue
            for entry in self.index["comparisons"]:
                if entry.get("kind") != "ab" or not entry.get("spec"):
                    continue
                mean, _ = arm_accept_length(entry["spec"].get("a" if side == "A" else "b"))
                if mean is None or mean <= 1.0:
                    self.index["warnings"].append(
                        f"arm {side} declares speculation but {entry['lane']} {entry['a' if side == 'A' else 'b']} "
                        f"reports accept length {mean!r}: speculation may not have run"
                    )
