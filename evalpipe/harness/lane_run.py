"""Drive one lane against an OpenAI-compatible endpoint and write the run folder.

Flow: load + hash-check the lane data -> ask the server who it is (model list, server info; refuse a
simulated-acceptance server) -> write manifest(start) -> send every planned (question, repeat) through
`concurrency` asyncio workers, each response graded and appended to responses.jsonl as it lands ->
summary.json + manifest(end). Ctrl-C keeps landed records and writes a partial summary.

Exit codes (`Outcome.exit_code`, README "Running lanes"): 0 every planned item has a non-error record;
EXIT_ERRORS_REMAIN when some ended as error records (the message names how many and the `--resume` command
that retries them); 3 refused (simulated acceptance); 130 SIGINT, 143 SIGTERM. A run that cannot start raises
RunError (the CLI exits 1).

Transport: harness/client.py (the real `openai` client, one retry policy: transport errors, timeouts, 5xx and
malformed bodies with exponential backoff, never 4xx); the body recorded is byte-for-byte the body sent.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from evalpipe.harness import client as http
from evalpipe.harness import manifest as manifest_mod
from evalpipe.harness import spec_metrics
from evalpipe.harness.client import EndpointError, Reply, Server
from evalpipe.harness.records import (
    MANIFEST_FILE,
    RESPONSES_FILE,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    SUPERSEDED_FILE,
    RecordWriter,
    counted_records,
    read_records,
    record_key,
    response_fields,
    rewrite_records,
    write_json,
)
from evalpipe.harness.server_facts import debug_faults, lossy_acceptance, simulation_reason
from evalpipe.harness.summary import compute_summary
from evalpipe.lanes import (
    Item,
    Lane,
    LaneData,
    computed_pins,
    id_list_sha256,
    item_groups,
    pin_differences,
    prompt_stream_sha256,
)
from evalpipe.digest import file_sha256
from evalpipe.lanes.data import DataError
from evalpipe.lanes.grading import GraderPool, grade_text
from evalpipe.redact import redact_text, scrub_values


EXIT_ERRORS_REMAIN = 4
EXIT_REFUSED = 3


class RunError(Exception):
    """A run cannot start or must stop; the message says why and what to do."""


class SimulatedServerRefused(RunError):
    """The server simulates speculative acceptance: its outputs are not scored."""


@dataclass
class RunConfig:
    lane: Lane
    base_url: str
    model: Optional[str] = None
    api_key: Optional[str] = None
    arm: str = "default"
    out_dir: Path = Path("results")
    concurrency: Optional[int] = None
    timeout_s: float = 14400.0
    max_retries: int = 3
    retry_backoff_s: float = 1.0
    overrides: dict = field(default_factory=dict)  # param name -> value (None = "do not send")
    num_examples: Optional[int] = None
    repeats: Optional[int] = None
    data_dir: Optional[Path] = None
    allow_data_drift: bool = False
    token_ids: bool = True
    logprobs: Optional[int] = None
    grader_workers: int = 2
    grader_timeout_s: float = 30.0
    fsync: bool = False
    progress: bool = True
    resume_dir: Optional[Path] = None
    command_line: list = field(default_factory=list)


@dataclass
class Outcome:
    run_dir: Path
    summary: dict
    exit_code: int
    message: Optional[str] = None


# ----------------------------------------------------------------------------------------- request bodies


def build_body(lane: Lane, model: str, item: Item, params: dict, token_ids: bool, logprobs: Optional[int],
               repeat: int = 0) -> dict:
    """The exact JSON body for one request. `None`-valued params are not sent (e.g. the x16 lane's seed). Repeat r
    of an item sends seed + r: one seed for every repeat would make sampled repeats copies of one sample where the
    server honours seeds (the engine does the same for the n choices of one request); repeat 0 keeps the seed."""
    body: dict = {"model": model}
    if lane.api == "completions":
        body["prompt"] = item.prompt
    else:
        body["messages"] = item.prompt
    for k, v in params.items():
        if v is not None:
            body[k] = v + repeat if k == "seed" and isinstance(v, int) else v
    if token_ids:
        body["return_token_ids"] = True
    if logprobs is not None:
        if lane.api == "completions":
            body["logprobs"] = logprobs
        else:
            body["logprobs"] = True
            body["top_logprobs"] = logprobs
    return body


# ------------------------------------------------------------------------------------------ the lane run


class LaneRun:
    """One lane against one endpoint: prepare (data, server identity), open the run folder, send, summarise."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.lane = cfg.lane
        self.recorded_url = redact_text(cfg.base_url)  # what records and manifests say: no URL password
        self.interrupted: Optional[str] = None
        self.refused: Optional[str] = None

    # ---- setup ------------------------------------------------------------------------------------------

    def prepare(self) -> None:
        cfg, lane = self.cfg, self.lane
        try:
            self.data: LaneData = lane.load(cfg.data_dir, cfg.allow_data_drift)
        except DataError as exc:
            raise RunError(str(exc)) from exc
        self.pin_diffs = pin_differences(lane, self.data)
        if self.pin_diffs and not cfg.allow_data_drift:
            raise RunError(
                f"lane {lane.name}: hashes differ from the pins in evalpipe/lanes/pins/{lane.name}.json:\n  " + "\n  ".join(self.pin_diffs)
                + "\nThe prompts are not the pinned ones; pass --allow-data-drift to run anyway (recorded)."
            )
        items = self.data.items
        if cfg.num_examples is not None:
            if cfg.num_examples < 1:
                raise RunError("--num-examples must be >= 1")
            items = items[: cfg.num_examples]
        self.items = items
        self.repeats = cfg.repeats if cfg.repeats is not None else lane.repeats
        if self.repeats < 1:
            raise RunError("--repeats must be >= 1")
        self.concurrency = cfg.concurrency or lane.concurrency
        self.params = {**lane.params, **cfg.overrides}

        with Server(cfg.base_url, cfg.api_key) as server:
            self._ask_server(server)

    def _ask_server(self, server: Server) -> None:
        """Who is the server? (before any generation request): its model, its settings, its /metrics counters."""
        cfg = self.cfg
        try:
            models_json = server.models()
        except EndpointError as exc:
            raise RunError(str(exc)) from exc
        served = [m["id"] for m in models_json["data"]]
        if cfg.model is None:
            self.model = served[0]
        elif cfg.model not in served:
            raise RunError(f"--model {cfg.model!r} is not served by {cfg.base_url} (it lists: {', '.join(served)})")
        else:
            self.model = cfg.model
        info_path, info = server.server_info()
        reason = simulation_reason(info)
        if reason:
            raise SimulatedServerRefused(f"refusing to score: {reason}. Restart the server without simulation.")
        # a lossy acceptance rule is scored (measuring its accuracy cost is its purpose), never hidden
        self.server_lossy = lossy_acceptance(info)
        if self.server_lossy:
            print(f"evalpipe run: warning: the server's speculative acceptance is LOSSY {self.server_lossy}; "
                  "the responses it decides measure that rule, not the model (scored on purpose)", file=sys.stderr)
        self.server_faults = debug_faults(info)
        if self.server_faults:
            print(f"evalpipe run: WARNING: THE SERVER IS BROKEN ON PURPOSE: planted debug faults "
                  f"{', '.join(self.server_faults)} (evalpipe serve --debug-fault); these scores measure the "
                  "faults, not the model", file=sys.stderr)
        self.server_facts = {"models": models_json, "server_info_path": info_path, "server_info": info}
        # speculative counters from /metrics (vLLM reports speculation nowhere else): run-level, before and after
        self.metrics_before = spec_metrics.snapshot(server)

    def _snapshot(self, server: dict) -> dict:
        cfg, lane, data = self.cfg, self.lane, self.data
        selected_digests = [it.prompt_sha256 for it in self.items]
        return manifest_mod.capture(
            lane_desc=lane.describe(),
            overrides=dict(cfg.overrides),
            effective={
                "params": self.params, "concurrency": self.concurrency, "repeats": self.repeats,
                "num_examples": cfg.num_examples, "return_token_ids": cfg.token_ids, "logprobs": cfg.logprobs,
                "model": self.model, "arm": cfg.arm,
            },
            transport={
                "timeout_s": cfg.timeout_s, "max_retries": cfg.max_retries, "retry_backoff_s": cfg.retry_backoff_s,
                "retry_policy": http.RETRY_POLICY,
                "grader_timeout_s": cfg.grader_timeout_s, "grader_workers": cfg.grader_workers, "fsync": cfg.fsync,
            },
            data_facts={
                "path": data.dataset_path,
                "sha256": data.dataset_sha256,
                "data_drift": data.data_drift,
                "allow_data_drift": cfg.allow_data_drift,
                "pin_differences": self.pin_diffs,
                "all_items": computed_pins(lane, data),
                "selected_id_list_sha256": id_list_sha256([it.question_id for it in self.items]),
                "selected_n_items": len(self.items),
                **data.extra,
            },
            prompt_facts={
                "template_id": data.template_id,
                "template_sha256": data.template_sha256,
                "prompt_stream_sha256_all": data.stream_sha256(),
                "prompt_stream_sha256_selected": prompt_stream_sha256(selected_digests),
            },
            endpoint={"base_url": self.recorded_url, "api": lane.api, "model": self.model},
            server=server,  # as the server reported it (redacted on write); comparisons drop what is volatile
        )

    # ---- run folder -------------------------------------------------------------------------------------

    def open_run_dir(self) -> None:
        cfg = self.cfg
        self.existing: list[dict] = []
        self.resumed = None
        if cfg.resume_dir is not None:
            self.run_dir = Path(cfg.resume_dir)
            old_manifest = json.loads((self.run_dir / MANIFEST_FILE).read_text())
            self.run_id = old_manifest["run_id"]
            resume_start = self._snapshot(self.server_facts)
            # the address may change (a restarted server, another host name); the server it reaches is compared
            protocol, _ = manifest_mod.differences(_without_base_url(old_manifest["start"]),
                                                   _without_base_url(resume_start))
            if protocol:  # checked before the folder is touched
                raise RunError("cannot resume: the protocol changed since the run started:\n  " + "\n  ".join(protocol))
            read = read_records(self.run_dir / RESPONSES_FILE)
            if read.bad_lines:
                raise RunError(f"{self.run_dir / RESPONSES_FILE}: lines {read.bad_lines[:10]} are not JSON; refusing to resume")
            # the records that count (records.py) stay, unless they are errors: those are retried
            kept = {id(r) for r in counted_records(read.records).by_key.values() if not r.get("error")}
            keep = [r for r in read.records if id(r) in kept]
            superseded = [r for r in read.records if id(r) not in kept]
            if superseded:
                with open(self.run_dir / SUPERSEDED_FILE, "a", encoding="utf-8") as fh:
                    for r in superseded:
                        fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            if superseded or read.torn_tail:
                rewrite_records(self.run_dir / RESPONSES_FILE, keep)
            self.existing = keep
            self.manifest = old_manifest
            self.resumed = {
                "at": time.time(), "kept_records": len(keep), "superseded_error_records": len(superseded),
                "dropped_torn_line": read.torn_tail,
            }
            self.manifest.setdefault("resumes", []).append(self.resumed)
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            self.run_id = f"{cfg.arm}-{stamp}-{secrets.token_hex(3)}"
            self.run_dir = Path(cfg.out_dir) / self.lane.name / self.run_id
            self.run_dir.mkdir(parents=True, exist_ok=False)
            self.manifest = {
                "schema_version": SCHEMA_VERSION,
                "run_id": self.run_id,
                "arm": cfg.arm,
                "lane": self.lane.name,
                "command_line": cfg.command_line,
                "started_at": time.time(),
                "start": None,
                "end": None,
            }
        if self.resumed is None:
            self.manifest["start"] = self._snapshot(self.server_facts)
        else:
            self.manifest["resume_start"] = resume_start
        self._write_manifest()

    # ---- requests ---------------------------------------------------------------------------------------

    def _record(self, item: Item, rep: int, seq: int, body: dict, reply: Reply, extracted: Any, correct: bool,
                status: str) -> dict:
        fields = response_fields(reply, chat=self.lane.api == "chat")
        return {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "arm": self.cfg.arm,
            "lane": self.lane.name,
            "question_id": item.question_id,
            "repeat_index": rep,
            "request_seq": seq,
            "endpoint": self.recorded_url,
            "model": self.model,
            "prompt_sha256": item.prompt_sha256,
            **({"group": item.group} if item.group is not None else {}),
            "request": body,
            **fields,
            "logprobs": fields["logprobs"] if self.cfg.logprobs is not None else None,
            "extracted_answer": extracted,
            "expected_answer": item.expected_answer,
            "correct": correct,
            "grade_status": status,
            "created_at": time.time(),
        }

    async def _worker(self, client, queue: asyncio.Queue, writer: RecordWriter, bar) -> None:
        path = "/completions" if self.lane.api == "completions" else "/chat/completions"
        while True:
            try:
                item, rep = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            self.seq += 1
            seq = self.seq
            body = build_body(self.lane, self.model, item, self.params, self.cfg.token_ids, self.cfg.logprobs, rep)
            attempts: list = []
            try:
                reply = await http.send(client, path, body, chat=self.lane.api == "chat",
                                        max_retries=self.cfg.max_retries, backoff_s=self.cfg.retry_backoff_s,
                                        secrets=[self.cfg.api_key or ""])
                attempts = reply.attempts
                if reply.data is None:
                    extracted, correct, status = None, False, "request_error"
                else:
                    fields = response_fields(reply, chat=self.lane.api == "chat")
                    text = fields["response_text"] if isinstance(fields["response_text"], str) else ""
                    extracted, correct, status = await grade_text(self.lane.grader, item.expected_answer, text,
                                                                  fields["truncated"], self.pool)
                rec = self._record(item, rep, seq, body, reply, extracted, correct, status)
            except Exception as exc:  # noqa: BLE001 - a surprise must still land as a record, never drop the item
                err = {"type": "internal_error", "status": None, "message": f"{type(exc).__name__}: {exc}"[:2000]}
                rec = self._record(item, rep, seq, body, Reply(None, 0.0, err, attempts), None, False, "request_error")
                correct = False
            writer.write(rec)
            self.records.append(rec)
            self.n_done += 1
            self.n_correct += bool(correct)
            self.n_err += bool(rec["error"])
            self.n_trunc += bool(rec["truncated"])
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(
                    f"acc={self.n_correct / max(1, self.n_done):.3f} err={self.n_err} trunc={self.n_trunc}",
                    refresh=False,
                )
            if isinstance(rec["spec"], dict) and rec["spec"].get("simulated") is True and self.refused is None:
                self.refused = "a response reports simulated speculative acceptance (spec.simulated = true)"
                me = asyncio.current_task()
                for t in self._workers:
                    if t is not me:
                        t.cancel()
                return

    async def _drive(self, todo: list[tuple[Item, int]]) -> None:
        cfg = self.cfg
        queue: asyncio.Queue = asyncio.Queue()
        for pair in todo:
            queue.put_nowait(pair)
        clients = http.openai_clients(cfg.base_url, cfg.api_key, cfg.timeout_s, self.concurrency)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.n_planned, initial=len(self.existing), desc=f"{self.lane.name}[{cfg.arm}]",
                       unit="req", file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
        loop = asyncio.get_running_loop()
        workers = self._workers = [asyncio.create_task(self._worker(clients[i % len(clients)], queue, self.writer, bar))
                                   for i in range(min(self.concurrency, max(1, len(todo))))]

        def on_signal(name: str) -> None:
            if self.interrupted is None:
                self.interrupted = name
                for t in workers:
                    t.cancel()

        for sig, name in ((signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM")):
            try:
                loop.add_signal_handler(sig, on_signal, name)
            except (NotImplementedError, RuntimeError):
                pass
        try:
            results = await asyncio.gather(*workers, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError):
                    pass
            if bar is not None:
                bar.close()
            for client in clients:
                await client.close()

    # ---- main -------------------------------------------------------------------------------------------

    def execute(self) -> Outcome:
        self.prepare()
        self.open_run_dir()
        plan = [(it, r) for it in self.items for r in range(self.repeats)]  # question-major
        self.n_planned = len(plan)
        done = {record_key(r) for r in self.existing}
        todo = [(it, r) for it, r in plan if (self.lane.name, it.question_id, r) not in done]
        self.records: list[dict] = list(self.existing)
        self.seq = max((int(r.get("request_seq", 0)) for r in self.existing), default=0)
        self.n_done = len(self.existing)
        self.n_correct = sum(1 for r in self.existing if r.get("correct"))
        self.n_err = 0
        self.n_trunc = sum(1 for r in self.existing if r.get("truncated"))
        self.pool = None
        t0 = time.perf_counter()
        self.writer = RecordWriter(self.run_dir / RESPONSES_FILE, fsync=self.cfg.fsync)
        try:
            if self.lane.grader == "ns_last_boxed" and todo:
                self.pool = GraderPool(workers=self.cfg.grader_workers, timeout_s=self.cfg.grader_timeout_s)
            asyncio.run(self._drive(todo))
        except KeyboardInterrupt:  # Ctrl-C before the loop's handler was installed (e.g. grader start-up)
            self.interrupted = self.interrupted or "SIGINT"
        finally:
            self.writer.close()
            if self.pool is not None:
                self.pool.close(wait=not self.interrupted)
        wall = time.perf_counter() - t0
        return self.finish(wall, len(todo))

    def finish(self, wall: float, n_sent_planned: int) -> Outcome:
        with Server(self.cfg.base_url, self.cfg.api_key) as server:
            end = self._snapshot(server.describe())
            metrics_after = spec_metrics.snapshot(server)
        start = self.manifest.get("resume_start") or self.manifest["start"]
        protocol, warnings = manifest_mod.differences(start, end)
        self.manifest["end"] = end
        self.manifest["finished_at"] = time.time()
        self.manifest["consistent"] = not protocol
        self.manifest["differences"] = protocol
        self.manifest["code_changes_during_run"] = warnings
        n_new = len(self.records) - len(self.existing)
        metrics = spec_metrics.run_level(self.metrics_before, metrics_after)
        if metrics is not None and self.resumed is not None:
            metrics["covers"] = "only the requests this resume sent"
        meta = {
            "arm": self.cfg.arm, "run_id": self.run_id, "model": self.model, "endpoint": self.recorded_url,
            "interrupted": self.interrupted, "refused": self.refused,
            "wall_s": wall, "requests_per_s": (n_new / wall) if wall > 0 else None,
            "overrides": dict(self.cfg.overrides, **({"num_examples": self.cfg.num_examples} if self.cfg.num_examples else {}),
                              **({"repeats": self.cfg.repeats} if self.cfg.repeats is not None else {})),
            "data_drift": self.data.data_drift, "manifest_changed": bool(protocol), "manifest_changes": protocol,
            "resumed": self.resumed is not None,
            "server_lossy_acceptance": self.server_lossy,
            "server_debug_faults": self.server_faults,
            "spec_metrics": metrics,
        }
        summary = compute_summary(
            lane_name=self.lane.name, grader=self.lane.grader, repeats=self.repeats,
            planned_question_ids=[it.question_id for it in self.items], records=self.records, meta=meta,
            groups=item_groups(self.items),
        )
        summary["partial"] = bool(self.interrupted or self.refused or summary["n_missing"] > 0)
        if self.refused:
            summary["accuracy"] = None
        write_json(self.run_dir / SUMMARY_FILE, summary)
        self.manifest["counts"] = {k: summary.get(k) for k in ("n_planned", "n_records", "n_errors", "n_truncated")}
        # the records file as it stood when the run (or its last resume) finished: audit catches any later edit,
        # including one that leaves every grade and count unchanged
        self.manifest["responses_sha256"] = file_sha256(self.run_dir / RESPONSES_FILE)
        self._write_manifest()
        if self.refused:
            return Outcome(self.run_dir, summary, EXIT_REFUSED,
                           f"refusing to score: {self.refused}; records kept in {self.run_dir}")
        if self.interrupted:
            code = 130 if self.interrupted == "SIGINT" else 143
            return Outcome(self.run_dir, summary, code, f"interrupted ({self.interrupted}): partial summary written; "
                           f"continue with:\n  {self.resume_command()}")
        unfinished = summary["n_errors"] + summary["n_missing"]
        if unfinished:
            kinds = _error_kinds(self.records)
            return Outcome(self.run_dir, summary, EXIT_ERRORS_REMAIN,
                           f"{unfinished} of {summary['n_planned']} planned items have no successful response "
                           f"({kinds}); they count as wrong. Retry just those with:\n  {self.resume_command()}")
        return Outcome(self.run_dir, summary, 0)

    def resume_command(self) -> str:
        """The exact command that continues this run (the endpoint comes from its manifest unless it moved)."""
        import shlex

        cmd = ["evalpipe", "run", "--resume", str(self.run_dir)]
        if self.recorded_url != self.manifest["start"]["endpoint"]["base_url"]:
            cmd += ["--base-url", self.recorded_url]
        line = shlex.join(cmd)
        if self.cfg.api_key:
            line += "   # with the same key in EVALPIPE_API_KEY (or --api-key)"
        return line

    def _write_manifest(self) -> None:
        write_json(self.run_dir / MANIFEST_FILE, scrub_values(self.manifest, [self.cfg.api_key or ""]))


def _without_base_url(snapshot: dict) -> dict:
    endpoint = {k: v for k, v in (snapshot.get("endpoint") or {}).items() if k != "base_url"}
    return {**snapshot, "endpoint": endpoint}


def _error_kinds(records: list[dict]) -> str:
    """`APIConnectionError x70, InternalServerError x3`: what the error records of a run were."""
    from collections import Counter

    counts = Counter((r.get("error") or {}).get("type") or "error" for r in records if r.get("error"))
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common()) or "no record"
