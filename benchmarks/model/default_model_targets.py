"""Does a model meet the default model's targets? Every target measured end to end through `evalpipe
serve`, `run`, `compare`, `qualify`, `repeat`, sgl-eval and the oracle test, and printed as one markdown table (target,
measured, pass, command); targets.json beside the run folders under --out holds every row with its full commands.

    python -m benchmarks.model.default_model_targets --out results/targets [--model PATH_OR_NAME] [--quick]
        [--skip t1,lossy] [--serve-args "--device cuda"] [--run-args "--concurrency 64"] [--fail-on-miss]

Rows (--skip takes their names):
- copy, retrieval, arith, boxed (chat-arith-boxed), think (chat-arith-boxed-think): greedy `evalpipe run` of the lane,
  spec off; retrieval must pass at every depth group, think shows its truncations;
- sgl-eval: `sgl-eval run gsm8k --from-dataset` on the first rows of datasets/arith-as-boxed.jsonl (the boxed lane's
  items, in its order) against the same server, scored by sgl-eval, within 1 point of the boxed row;
- qualify, qualify-keys: `evalpipe qualify` with its default gates, against a server without keys and against one
  started with two `--api-key`s (qualify given both); pass = exit code 0;
- repeat: `evalpipe repeat`'s arithmetic and exact_copy controls; each response is graded against the fixture's
  expected answer (evalpipe/lanes/repeat_fixtures.py: the last integer equals 155; the reply's first line is the
  copied text and nothing more), so the row checks exactness, not agreement: pass = every response of every
  condition right (the same rule as `evalpipe repeat --fail-on-control`);
- spec: the layerskip drafter (`--speculative block`, G = 5, the default drafter) on greedy arith: accept length
  >= 3.0 and every output token-identical to the spec-off run;
- oracle: tests/engine/test_engine_oracle.py's shipped-model test on --model's weights (greedy tokens equal
  transformers' DeepseekV4ForCausalLM in float32);
- t1: temperature 1 arith, spec on - off inside 2 points and McNemar p >= 0.01;
- lossy: a lossy speculator (--lossy-args) against exact greedy arith: p < 0.01 and not "non-inferior".
  The trained layer-4 drafter nearly always proposes the target's own argmax, so top-k acceptance behind it changes
  few tokens; a weaker drafter behind the same knob is what the check has to catch.
Servers are booted fresh for each configuration on free ports and stopped afterwards. --quick runs a small subset of
each lane (every group), a 10 s soak and 4 repeats; --smoke is CI's check (the tiny model, 2 items, 8 tokens, the
rows whose steps no other row takes).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import httpx

from evalpipe.lanes.chat_arith_boxed import SGL_EVAL, sgl_eval_command

REPO = Path(__file__).resolve().parents[2]
EVALPIPE = [sys.executable, "-m", "evalpipe.cli"]
BOXED_DATASET = REPO / "datasets" / "arith-as-boxed.jsonl"
ORACLE_TEST = "tests/engine/test_engine_oracle.py::test_shipped_default_model_matches_transformers_on_lane_prompts"
ORACLE_MODEL_ENV = "EVALPIPE_ORACLE_MODEL"  # what the oracle test reads its checkpoint from

LANE_ROWS = {  # row name -> (lane, items in --quick, target share, the target's words)
    "copy": ("copy", 30, 0.99, "copy greedy >= 99%"),
    "retrieval": ("retrieval", 25, 0.95, "retrieval greedy >= 95% at every depth"),
    "arith": ("arith", 60, 0.90, "arith greedy >= 90%"),
    "boxed": ("chat-arith-boxed", 30, 0.85, "chat-arith-boxed >= 85% (sgl-eval's grader)"),
    "think": ("chat-arith-boxed-think", 30, 0.80, "chat-arith-boxed-think >= 80%, truncations counted"),
}
ROWS = (*LANE_ROWS, "sgl-eval", "qualify", "qualify-keys", "repeat", "spec", "oracle", "t1", "lossy")
ACCEPT_LENGTH_TARGET = 3.0
SGL_EVAL_POINTS = 1.0
SHOWN_WITHOUT_VALUE = {"--no-progress"}
SHOWN_WITHOUT = {"--base-url", "--out", "--out-dir", "--arm"}  # per-run plumbing, dropped from the table's command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shown(argv: list[str], secrets_: tuple[str, ...] = (), brief: bool = False) -> str:
    """The command as a user types it: `evalpipe ...` for this interpreter's module, keys as $KEY1, $KEY2 ...; brief
    drops the per-run plumbing (URL, output folders, arm) for the table."""
    words = ["evalpipe"] + argv[len(EVALPIPE) :] if argv[: len(EVALPIPE)] == EVALPIPE else list(argv)
    words = [f"$KEY{secrets_.index(w) + 1}" if w in secrets_ else w for w in words]
    if words and words[0] == SGL_EVAL:
        words[0] = "sgl-eval"
    if brief:
        kept, skip_next = [], False
        for w in words:
            if skip_next:
                skip_next = False
            elif w in SHOWN_WITHOUT:
                skip_next = True
            elif w not in SHOWN_WITHOUT_VALUE:
                kept.append(w)
        words = kept
    return " ".join(w if w.startswith("$KEY") else shlex.quote(w) for w in words)


@dataclass
class Row:
    name: str  # what --skip calls it
    target: str
    measured: str
    passed: Optional[bool]  # None: the row could not be measured
    commands: list[str]  # full, in order (the server first)
    brief: str  # the command as the table shows it
    where: str  # the run folder or log this row read
    wall_s: float  # since the previous row (a run two rows share is counted in the first)
    facts: dict = field(default_factory=dict)


class Server:
    """`evalpipe serve` on a free port, until the with-block ends; its output goes to `log`."""

    extra: list[str] = []

    def __init__(self, *args: str, log: Path, keys: tuple[str, ...] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.keys = keys
        key_args = [a for k in keys for a in ("--api-key", k)]
        self.cmd = [*EVALPIPE, "serve", "--port", str(self.port), *args, *self.extra, *key_args]
        self.command = shown(self.cmd, keys)
        self.brief = shown([c for c in self.cmd if c not in ("--port", str(self.port))], keys, brief=True)
        print("$", self.command, flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        with httpx.Client(timeout=30) as client:  # one client: each new one builds an SSL context (~30 ms of CPU)
            for _ in range(1200):
                try:  # /health* answers without a key
                    if client.get(f"http://127.0.0.1:{self.port}/health_generate").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if self.proc.poll() is not None:
                    raise SystemExit(f"server exited: see {log}")
                time.sleep(0.5)
        self.proc.terminate()
        raise SystemExit(f"server not ready: see {log}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(60)


def call(cmd: list[str], log: Path, keys: tuple[str, ...] = (), env: Optional[dict] = None, cwd=None) -> int:
    """Run one client command to the end, its output to `log`; its exit code."""
    print("$", shown(cmd, keys), flush=True)
    with open(log, "w") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, check=False).returncode


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


class Targets:
    """One measurement: the settings, the run folders already made (reused across rows) and the rows so far."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.out = args, args.out
        self.run_extra = shlex.split(args.run_args)
        self.rows: list[Row] = []
        self.lane_runs: dict[tuple[str, str], dict] = {}
        self.clock = time.time()

    def examples(self, row: str) -> Optional[int]:
        """Items for a lane row: the whole lane, --quick's subset, or --smoke's 2; --arith-examples for arith."""
        if row == "arith" and self.args.arith_examples:
            return self.args.arith_examples
        if self.args.smoke:
            return 2
        return LANE_ROWS[row][1] if self.args.quick else None

    def lane_run(self, row: str, server: Server, arm: str, *extra: str) -> dict:
        """`evalpipe run` of the row's lane (once per arm and flags): {dir, summary, step: (server, argv)}."""
        key = (row, arm + " ".join(extra))
        if key in self.lane_runs:
            return self.lane_runs[key]
        lane, n = LANE_ROWS[row][0], self.examples(row)
        out = self.out / arm
        cmd = [*EVALPIPE, "run", lane, "--base-url", server.url, "--out", str(out), "--arm", arm, "--no-progress"]
        cmd += [*(["--num-examples", str(n)] if n else []), *self.run_extra, *extra]
        out.mkdir(parents=True, exist_ok=True)
        call(cmd, out / f"{lane}.log")
        found = sorted((out / lane).glob(f"{arm}-*"))
        if not found or not (found[-1] / "summary.json").exists():
            raise SystemExit(f"evalpipe run {lane} left no summary: see {out / f'{lane}.log'}")
        run = {"dir": found[-1], "summary": json.loads((found[-1] / "summary.json").read_text()), "step": (server, cmd)}
        self.lane_runs[key] = run
        return run

    def add(
        self,
        name: str,
        target: str,
        measured: str,
        passed: Optional[bool],
        steps: list[tuple[Optional[Server], list[str]]],
        where: Path,
        keys: tuple[str, ...] = (),
        **facts,
    ) -> None:
        """A measured row; `steps` are its commands in order, each after the server it ran against (None: none)."""
        commands, shown_steps, last = [], [], None
        for server, argv in steps:
            if server is not None and server is not last:
                commands.append(server.command)
                shown_steps.append(server.brief)
            last = server
            commands.append(shown(argv, keys))
            shown_steps.append(shown(argv, keys, brief=True))
        brief = " ; ".join(f"`{c}`" for c in shown_steps)
        wall, self.clock = time.time() - self.clock, time.time()
        self.rows.append(Row(name, target, measured, passed, commands, brief, str(where), round(wall, 1), facts))
        mark = {True: "pass", False: "FAIL", None: "not measured"}[passed]
        print(f"  -> [{mark}, {wall:.0f} s] {target} | {measured}", flush=True)

    # ------------------------------------------------------------------------------------------------ the rows

    def lane_row(self, row: str, server: Server) -> None:
        lane, _, share, target = LANE_ROWS[row]
        run = self.lane_run(row, server, "off")
        s = run["summary"]
        groups = s.get("by_group") or {}
        text = f"{pct(s['accuracy'])} of {s['n_planned']}"
        if groups:
            text += " (" + ", ".join(f"{g} {pct(v['accuracy'])}" for g, v in groups.items()) + ")"
        if row in ("copy", "think") or s.get("n_truncated"):
            text += f"; {s.get('n_truncated', 0)} truncated"
        if s.get("n_errors"):
            text += f"; {s['n_errors']} request errors"
        scores = [v["accuracy"] for v in groups.values()] if row == "retrieval" and groups else [s["accuracy"]]
        self.add(
            row,
            target,
            text,
            min(scores) >= share,
            [run["step"]],
            run["dir"],
            accuracy=s["accuracy"],
            by_group=groups,
            n_truncated=s.get("n_truncated"),
        )

    def sgl_eval_row(self, server: Server) -> None:
        """sgl-eval's own score of the boxed lane's items (the dataset file mirrors the lane, in id order)."""
        ours = self.lane_run("boxed", server, "off")
        n = ours["summary"]["n_planned"]
        out = self.out / "sgl-eval"
        out.mkdir(parents=True, exist_ok=True)
        subset = out / "arith-as-boxed.jsonl"
        subset.write_text("".join(BOXED_DATASET.read_text().splitlines(keepends=True)[:n]))
        cmd = sgl_eval_command(subset, server.url, out, max_tokens=8 if self.args.smoke else None)
        rc = call(cmd, out / "sgl-eval.log")
        metrics = sorted(out.rglob("metrics.json"))
        target = f"sgl-eval on arith-as-boxed within {SGL_EVAL_POINTS:g} point of chat-arith-boxed"
        if rc != 0 or not metrics:
            self.add("sgl-eval", target, f"sgl-eval exited {rc}", None, [(server, cmd)], out / "sgl-eval.log")
            return
        theirs, mine = json.loads(metrics[-1].read_text())["aggregate"]["score"], ours["summary"]["accuracy"]
        diff = 100 * (theirs - mine)
        self.add(
            "sgl-eval",
            target,
            f"{pct(theirs)} vs {pct(mine)} of {n} ({diff:+.2f} pt)",
            abs(diff) <= SGL_EVAL_POINTS,
            [(server, cmd)],
            metrics[-1].parent,
            sgl_eval=theirs,
            evalpipe=mine,
        )

    def qualify_row(self, name: str, server: Server) -> None:
        out = self.out / name
        cmd = [*EVALPIPE, "qualify", "--base-url", server.url, "--out", str(out), "--no-progress"]
        cmd += [a for k in server.keys for a in ("--api-key", k)] + shlex.split(self.args.qualify_args)
        rc = call(cmd, self.out / f"{name}.log", server.keys)
        result = json.loads((out / "qualify.json").read_text()) if (out / "qualify.json").exists() else {}
        gates = {g["gate"]: g["verdict"] for g in result.get("gates", [])}
        text = f"exit {rc}: " + (", ".join(f"{g} {v}" for g, v in gates.items()) or "no qualify.json")
        for g in result.get("gates", []):
            if g["verdict"] not in ("pass", "skipped"):
                text += f"; {g['gate']} {g['passed']}/{g['requests']} requests passed, first: {g['reason'][:120]}"
        keys = f"with {len(server.keys)} --api-keys" if server.keys else "no key"
        self.add(
            name,
            f"evalpipe qualify, default gates, {keys}, exits 0",
            text,
            rc == 0,
            [(server, cmd)],
            out if result else self.out / f"{name}.log",
            server.keys,
            exit_code=rc,
            gates=gates,
        )

    def repeat_row(self, server: Server) -> None:
        """The controls are graded per response against the fixture's expected answer (repeat's `correct`)."""
        out = self.out / "repeat"
        cmd = [*EVALPIPE, "repeat", "--base-url", server.url, "--fixtures", "arithmetic,exact_copy", "--out", str(out)]
        cmd += shlex.split(self.args.repeat_args)
        rc = call(cmd, self.out / "repeat.log")
        found = sorted(out.glob("repeat/*/repeat.json"))
        target = "repeat's arithmetic and exact-copy controls exact in every response"
        if rc != 0 or not found:
            self.add("repeat", target, f"evalpipe repeat exited {rc}", None, [(server, cmd)], self.out / "repeat.log")
            return
        groups = json.loads(found[-1].read_text())["groups"]
        parts, ok, facts = [], True, {}
        for fixture in ("arithmetic", "exact_copy"):
            conds = groups.get(fixture, {})
            right = sum(round(g.get("control_correct_share", 0) * (g["n"] - g["n_errors"])) for g in conds.values())
            total = sum(g["n"] for g in conds.values())
            modes = sorted({ascii((g.get("mode_text") or "")[:40]) for g in conds.values()})
            ok &= bool(conds) and right == total
            parts.append(
                f"{fixture} {right}/{total} right over {len(conds)} conditions (modal replies {', '.join(modes)})"
            )
            facts[fixture] = {"right": right, "n": total, "modal_replies": modes}
        note = (
            "graded against the expected answer (arithmetic: last integer; copy: the whole first line), not agreement"
        )
        self.add("repeat", target, "; ".join(parts) + f"; {note}", ok, [(server, cmd)], found[-1].parent, **facts)

    def spec_row(self, off: Server, on: Server) -> None:
        a, b = self.lane_run("arith", off, "off"), self.lane_run("arith", on, "on")
        c, cmd = self.compare(a, b, "compare-spec")
        accept, agree = c["spec"]["b"]["accept_length_mean"], c["agreement"]
        same, pairs = agree.get("n_identical"), agree.get("n_pairs")
        self.add(
            "spec",
            f"layerskip accept length >= {ACCEPT_LENGTH_TARGET:g} (G=5, greedy arith), token-identical",
            f"{'none' if accept is None else f'{accept:.2f}'}; {same}/{pairs} outputs identical to spec off",
            accept is not None and accept >= ACCEPT_LENGTH_TARGET and same == pairs and bool(pairs),
            [a["step"], b["step"], (None, cmd)],
            self.out / "compare-spec",
            accept_length=accept,
            identical=same,
            pairs=pairs,
        )

    def oracle_row(self) -> None:
        """The oracle test itself, pointed at --model (a path given relative to the caller's folder made absolute)."""
        model = self.args.model
        model = str(Path(model).resolve()) if Path(model).exists() else model
        cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider", ORACLE_TEST]
        env = {**os.environ, ORACLE_MODEL_ENV: model}
        log = self.out / "oracle.log"
        rc = call(cmd, log, env=env, cwd=REPO)
        lines = [ln for ln in log.read_text().splitlines() if "greedy tokens" in ln]
        measured = f"pytest exit {rc}: " + ("; ".join(lines) or "no report line")
        shown_cmd = [f"{ORACLE_MODEL_ENV}={model}", "python", *cmd[1:]]
        self.add(
            "oracle",
            "oracle test on the model's weights (greedy tokens = transformers, float32)",
            measured,
            rc == 0,
            [(None, shown_cmd)],
            log,
            exit_code=rc,
        )

    def t1_row(self, off: Server, on: Server) -> None:
        a = self.lane_run("arith", off, "t1-off", "--temperature", "1")
        b = self.lane_run("arith", on, "t1-on", "--temperature", "1")
        c, cmd = self.compare(a, b, "compare-t1", "--margin", "2")
        g = c["greedy"]
        self.add(
            "t1",
            "T=1 arith, spec on - off inside 2 pt, McNemar p >= 0.01",
            f"{100 * g['diff']:+.2f} pt ({pct(g['n_correct_a'] / g['n'])} vs {pct(g['n_correct_b'] / g['n'])} "
            f"of {g['n']}; McNemar p {g['mcnemar_p']:.3g}; {g['verdict']} at -2 pt)",
            abs(g["diff"]) <= 0.02 and g["mcnemar_p"] >= 0.01,
            [a["step"], b["step"], (None, cmd)],
            self.out / "compare-t1",
        )

    def lossy_row(self, off: Server, lossy: Server) -> None:
        a, b = self.lane_run("arith", off, "off"), self.lane_run("arith", lossy, "lossy")
        c, cmd = self.compare(a, b, "compare-lossy")
        g = c["greedy"]
        self.add(
            "lossy",
            f"lossy ({self.args.lossy_args}) caught: McNemar p < 0.01, not non-inferior",
            f"{100 * g['diff']:+.2f} pt ({g['a_only']} lost / {g['b_only']} gained; McNemar p "
            f"{g['mcnemar_p']:.3g}; {g['verdict']})",
            g["mcnemar_p"] < 0.01 and g["verdict"] != "non-inferior",
            [a["step"], b["step"], (None, cmd)],
            self.out / "compare-lossy",
        )

    def compare(self, a: dict, b: dict, name: str, *extra: str) -> tuple[dict, list[str]]:
        out = self.out / name
        cmd = [*EVALPIPE, "compare", str(a["dir"]), str(b["dir"]), "--out", str(out), "--intended", "*spec*", *extra]
        call(cmd, self.out / f"{name}.log")
        return json.loads((out / "compare.json").read_text()), cmd


def measure(args: argparse.Namespace) -> Targets:
    """Every row not skipped, one server configuration at a time."""
    t, skip, model = Targets(args), set(args.skip), ["--model", args.model]

    def serve(name: str, *flags: str, keys: tuple[str, ...] = ()) -> Server:
        return Server(*model, *flags, log=args.out / f"serve-{name}.log", keys=keys)

    def guarded(row: str, fn: Callable[[], None]) -> None:
        if row not in skip:
            fn()

    with serve("off") as off:
        for row in LANE_ROWS:
            guarded(row, lambda row=row: t.lane_row(row, off))
        guarded("sgl-eval", lambda: t.sgl_eval_row(off))
        guarded("repeat", lambda: t.repeat_row(off))
        guarded("qualify", lambda: t.qualify_row("qualify", off))
        if {"spec", "lossy"} - skip:
            t.lane_run("arith", off, "off")
        if "t1" not in skip:
            t.lane_run("arith", off, "t1-off", "--temperature", "1")
    if "qualify-keys" not in skip:
        with serve("keys", keys=(secrets.token_urlsafe(16), secrets.token_urlsafe(16))) as keyed:
            t.qualify_row("qualify-keys", keyed)
    if {"spec", "t1"} - skip:
        with serve("on", "--speculative", "block") as on:
            guarded("spec", lambda: t.spec_row(off, on))
            guarded("t1", lambda: t.t1_row(off, on))
    if "lossy" not in skip:
        with serve("lossy", "--speculative", "block", *shlex.split(args.lossy_args)) as lossy:
            t.lossy_row(off, lossy)
    guarded("oracle", t.oracle_row)
    return t


def table(rows: list[Row]) -> str:
    lines = ["| target | measured | pass | command |", "|---|---|---|---|"]
    for r in rows:
        mark = {True: "pass", False: "**FAIL**", None: "not measured"}[r.passed]
        lines.append(f"| {r.target} | {r.measured.replace('|', '/')} | {mark} | {r.brief.replace('|', '/')} |")
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for the run folders, logs, targets.json/.md "
        "(required but with --smoke, which uses a fresh temporary folder)",
    )
    ap.add_argument(
        "--model",
        default="evalpipe-skills-dsv4",
        help="checkpoint folder or built-in name, as `evalpipe serve --model` takes it [default: %(default)s]",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="a subset of every lane (each group: copy 30, retrieval 25, "
        "arith 60, boxed and think 30; sgl-eval the boxed items), a 10 s qualify soak, 4 repeats",
    )
    ap.add_argument(
        "--arith-examples",
        type=int,
        default=None,
        help="arith items per run, overriding the whole lane (1200) or --quick's 60",
    )
    ap.add_argument("--skip", default="", help=f"comma-separated rows not to measure: {','.join(ROWS)}")
    ap.add_argument("--serve-args", default="", help='added to every `evalpipe serve` (e.g. "--device cuda")')
    ap.add_argument("--run-args", default="", help='added to every `evalpipe run` (e.g. "--concurrency 64")')
    ap.add_argument(
        "--qualify-args",
        default=None,
        help="added to both `evalpipe qualify` runs [default: none; --quick: --soak-duration 10]",
    )
    ap.add_argument(
        "--repeat-args", default=None, help="added to `evalpipe repeat` [default: none; --quick: --repeats 4]"
    )
    ap.add_argument(
        "--lossy-args",
        default="--drafter layerskip:1 --spec-accept-topk 4",
        help="the lossy server's flags, added to `--speculative block` [default: %(default)s]",
    )
    ap.add_argument(
        "--fail-on-miss",
        action="store_true",
        help="exit 1 when a measured target fails (or a row "
        "could not be measured); by default the script exits 0 once the table is written",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check, seconds: the tiny model, 2 items per lane and "
        "8 tokens, qualify's auth gate only (against the keyed server), 2 serial repeats, no arith, think, qualify "
        "(no key), spec, oracle, t1 and lossy rows",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        # arith and think take lane_row's steps that copy, retrieval and boxed take; qualify-keys takes qualify's
        # (with keys): each left-out row would only add a client process
        args.model, args.skip = (
            "evalpipe-tiny-dsv4",
            ",".join(filter(None, [args.skip, "arith", "think", "qualify", "spec", "oracle", "t1", "lossy"])),
        )
        args.run_args += " --max-tokens 8"
        args.qualify_args = args.qualify_args or "--gates auth"
        args.repeat_args = args.repeat_args or "--repeats 2 --conditions serial"
        args.out = args.out or Path(tempfile.mkdtemp(prefix="default-model-targets-"))
    elif args.out is None:
        ap.error("--out is required")
    if args.qualify_args is None:
        args.qualify_args = "--soak-duration 10" if args.quick else ""
    if args.repeat_args is None:
        args.repeat_args = "--repeats 4" if args.quick else ""
    if args.arith_examples is not None and args.arith_examples < 1:
        ap.error("--arith-examples must be at least 1")
    args.skip = list(dict.fromkeys(s.strip() for s in args.skip.split(",") if s.strip()))
    unknown = sorted(set(args.skip) - set(ROWS))
    if unknown:
        ap.error(f"unknown --skip row(s) {', '.join(unknown)}; choose from {', '.join(ROWS)}")
    return args


def main() -> None:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    Server.extra = shlex.split(args.serve_args)
    t0 = time.time()
    rows = measure(args).rows
    wall = time.time() - t0
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    md = f"Default-model targets, {args.model} ({mode}, {wall:.0f} s)\n\n{table(rows)}\n"
    (args.out / "targets.md").write_text(md)
    record = {
        "model": args.model,
        "mode": mode,
        "wall_s": round(wall, 1),
        "argv": sys.argv[1:],
        "rows": [asdict(r) for r in rows],
    }
    (args.out / "targets.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n" + md)
    print(f"wrote {args.out / 'targets.md'} and {args.out / 'targets.json'}")
    if args.fail_on_miss and any(r.passed is not True for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
