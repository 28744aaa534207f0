"""Drive one lane against an OpenAI-compatible endpoint and write the run folder.

Flow: `LaneRun.prepare` -> a frozen `PreparedRun` (prepare.py: data hash-checked, items selected, the server asked who
it is, a simulated-acceptance server refused) -> `execute`: `RunFolder` (run_folder.py) creates or resumes the folder
and its manifest(start) -> `RequestSender` sends every planned (question, repeat) through `concurrency` asyncio
workers, each response graded and appended to responses.jsonl as a `Record` as it lands -> `finish`: summary.json +
manifest(end). Ctrl-C keeps landed records and writes a partial summary.

Exit codes: `EXIT_CODES` below (`RunOutcome.exit_code`; `evalpipe run --help` prints the table). A run that
cannot start raises RunError.

Transport: harness/client.py (the real `openai` client, one retry policy: transport errors, timeouts, 5xx and
malformed bodies with exponential backoff, never 4xx); the body recorded is byte-for-byte the body sent.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from evalpipe.harness import client as http
from evalpipe.harness import spec_metrics
from evalpipe.harness.client import Reply, Server
from evalpipe.harness.prepare import (
    PreparedRun,
    RunConfig,
    RunError,
    SimulatedServerRefused,
    prepare_run,
)
from evalpipe.harness.records import (
    SCHEMA_VERSION,
    Record,
    RecordWriter,
    record_key,
    response_fields,
)
from evalpipe.harness.run_folder import RunFolder
from evalpipe.harness.sample_seeds import sample_seed
from evalpipe.harness.summary import compute_summary
from evalpipe.lanes import Item, Lane, item_groups
from evalpipe.lanes.grading import GraderPool, grade_text, grader_pool

__all__ = [
    "EXIT_CODES",
    "EXIT_ERRORS_REMAIN",
    "EXIT_REFUSED",
    "LaneRun",
    "RunConfig",
    "RunError",
    "RunOutcome",
    "PreparedRun",
    "SimulatedServerRefused",
    "build_body",
]

EXIT_CANNOT_START = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_ERRORS_REMAIN = 4
EXIT_SIGINT = 130
EXIT_SIGTERM = 143
# (code, meaning): the one table of `evalpipe run`'s exit codes (its --help prints it)
EXIT_CODES = (
    ("0", "every planned item has a non-error record"),
    (str(EXIT_CANNOT_START), "the run could not start (unreachable server, unknown model, data pins, ...)"),
    (str(EXIT_USAGE), "usage error, or a --resume folder with a malformed or missing file (named, with its line)"),
    (str(EXIT_REFUSED), "refused: a response reports simulated speculative acceptance (records kept)"),
    (
        str(EXIT_ERRORS_REMAIN),
        "finished, but some items ended as error records; the count and the --resume command are printed",
    ),
    (
        f"{EXIT_SIGINT}",
        f"interrupted by Ctrl-C ({EXIT_SIGTERM}: SIGTERM); landed records kept, partial summary, resume command "
        "printed",
    ),
)


# ----------------------------------------------------------------------------------------- request bodies


def build_body(
    lane: Lane,
    model: str,
    item: Item,
    params: dict,
    token_ids: bool,
    logprobs: Optional[int],
    repeat: int = 0,
    sample_seeds: Optional[int] = None,
) -> dict:
    """The exact JSON body for one request. `None`-valued params are not sent (e.g. the x16 lane's seed). Repeat r
    of an item sends seed + r: one seed for every repeat would make sampled repeats copies of one sample where the
    server honours seeds (the engine does the same for the n choices of one request); repeat 0 keeps the seed.
    With `sample_seeds` (--sample-seeds BASE) the seed sent is sample_seeds.sample_seed(BASE, question, repeat)."""
    body: dict = {"model": model}
    if lane.api == "completions":
        body["prompt"] = item.prompt
    else:
        body["messages"] = item.prompt
    for k, v in params.items():
        if v is not None:
            body[k] = v + repeat if k == "seed" and isinstance(v, int) else v
    if sample_seeds is not None:
        body["seed"] = sample_seed(sample_seeds, item.question_id, repeat)
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


@dataclass
class RunOutcome:
    """How a run ended: its folder, its summary, the exit code and, unless 0, what to do next."""

    run_dir: Path
    summary: dict
    exit_code: int
    message: Optional[str] = None
    server_info: Any = None  # what the server reported when the run was prepared


class LaneRun:
    """One lane against one endpoint: `prepare` settles the run (data, server identity), `execute` opens the run
    folder, sends every planned request and writes the summary."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    def prepare(self) -> PreparedRun:
        return prepare_run(self.cfg)

    def execute(self, prepared: Optional[PreparedRun] = None) -> RunOutcome:
        prepared = prepared or self.prepare()
        folder = RunFolder.resume(prepared) if prepared.cfg.resume_dir is not None else RunFolder.create(prepared)
        sender = RequestSender(prepared, folder)
        t0 = time.perf_counter()
        sender.send_all()
        outcome = finish(prepared, folder, sender, time.perf_counter() - t0)
        outcome.server_info = prepared.server.facts.get("server_info")
        return outcome


class RequestSender:
    """The requests of one run in flight: `concurrency` asyncio workers share one queue, and each response is
    graded and appended to responses.jsonl as it lands. Holds what changes while they run (counts, the records,
    why it stopped early)."""

    def __init__(self, prepared: PreparedRun, folder: RunFolder):
        self.prepared, self.folder = prepared, folder
        kept = folder.kept
        done = {record_key(r) for r in kept}
        planned = prepared.planned()
        self.n_planned = len(planned)
        self.todo = [(it, r) for it, r in planned if (prepared.lane.name, it.question_id, r) not in done]
        self.records: list[Record] = list(kept)
        self.seq = max((int(r.request_seq) for r in kept), default=0)
        self.n_done = len(kept)
        self.n_correct = sum(1 for r in kept if r.correct)
        self.n_err = 0
        self.n_trunc = sum(1 for r in kept if r.truncated)
        self.interrupted: Optional[str] = None  # "SIGINT" / "SIGTERM"
        self.refused: Optional[str] = None  # why the run stopped scoring
        self.pool: Optional[GraderPool] = None
        self._workers: list = []

    def send_all(self) -> None:
        cfg = self.prepared.cfg
        writer = RecordWriter(self.folder.responses, fsync=cfg.fsync)
        try:
            if self.todo:
                self.pool = grader_pool(self.prepared.lane.grader, cfg.grader_workers, cfg.grader_timeout_s)
            asyncio.run(self._drive(writer))
        except KeyboardInterrupt:  # Ctrl-C before the loop's handler was installed (e.g. grader start-up)
            self.interrupted = self.interrupted or "SIGINT"
        finally:
            writer.close()
            if self.pool is not None:
                self.pool.close(wait=not self.interrupted)

    def _record(
        self, item: Item, rep: int, seq: int, body: dict, reply: Reply, extracted: Any, correct: bool, status: str
    ) -> Record:
        prepared = self.prepared
        fields = response_fields(reply, chat=prepared.lane.api == "chat")
        if prepared.cfg.logprobs is None:
            fields["logprobs"] = None
        return Record(
            schema_version=SCHEMA_VERSION,
            run_id=self.folder.run_id,
            arm=prepared.cfg.arm,
            lane=prepared.lane.name,
            question_id=item.question_id,
            repeat_index=rep,
            request_seq=seq,
            endpoint=prepared.recorded_url,
            model=prepared.model,
            prompt_sha256=item.prompt_sha256,
            group=item.group,
            request=body,
            **fields,
            server_deterministic=prepared.server.deterministic,
            extracted_answer=extracted,
            expected_answer=item.expected_answer,
            correct=correct,
            grade_status=status,
            created_at=time.time(),
        )

    async def _worker(self, client, queue: asyncio.Queue, writer: RecordWriter, bar) -> None:
        prepared, cfg = self.prepared, self.prepared.cfg
        chat = prepared.lane.api == "chat"
        path = "/chat/completions" if chat else "/completions"
        while True:
            try:
                item, rep = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            self.seq += 1
            seq = self.seq
            body = build_body(
                prepared.lane, prepared.model, item, prepared.params, cfg.token_ids, cfg.logprobs, rep, cfg.sample_seeds
            )
            attempts: list = []
            try:
                reply = await http.send(
                    client,
                    path,
                    body,
                    chat=chat,
                    max_retries=cfg.max_retries,
                    backoff_s=cfg.retry_backoff_s,
                    secrets=[cfg.api_key or ""],
                )
                attempts = reply.attempts
                if reply.data is None:
                    extracted, correct, status = None, False, "request_error"
                else:
                    fields = response_fields(reply, chat=chat)
                    text = fields["response_text"] if isinstance(fields["response_text"], str) else ""
                    extracted, correct, status = await grade_text(
                        prepared.lane.grader, item.expected_answer, text, fields["truncated"], self.pool
                    )
                rec = self._record(item, rep, seq, body, reply, extracted, correct, status)
            except Exception as exc:  # noqa: BLE001 - a surprise must still land as a record, never drop the item
                err = {"type": "internal_error", "status": None, "message": f"{type(exc).__name__}: {exc}"[:2000]}
                rec = self._record(item, rep, seq, body, Reply(None, 0.0, err, attempts), None, False, "request_error")
            writer.write(rec.as_json())
            self.records.append(rec)
            self.n_done += 1
            self.n_correct += bool(rec.correct)
            self.n_err += bool(rec.error)
            self.n_trunc += bool(rec.truncated)
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(
                    f"acc={self.n_correct / max(1, self.n_done):.3f} err={self.n_err} trunc={self.n_trunc}",
                    refresh=False,
                )
            if isinstance(rec.spec, dict) and rec.spec.get("simulated") is True and self.refused is None:
                self.refused = "a response reports simulated speculative acceptance (spec.simulated = true)"
                me = asyncio.current_task()
                for t in self._workers:
                    if t is not me:
                        t.cancel()
                return

    async def _drive(self, writer: RecordWriter) -> None:
        prepared, cfg = self.prepared, self.prepared.cfg
        queue: asyncio.Queue = asyncio.Queue()
        for pair in self.todo:
            queue.put_nowait(pair)
        clients = http.openai_clients(cfg.base_url, cfg.api_key, cfg.timeout_s, prepared.concurrency)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=self.n_planned,
                initial=len(self.folder.kept),
                desc=f"{prepared.lane.name}[{cfg.arm}]",
                unit="req",
                file=sys.stderr,
                mininterval=0.5,
                dynamic_ncols=True,
            )
        loop = asyncio.get_running_loop()
        workers = self._workers = [
            asyncio.create_task(self._worker(clients[i % len(clients)], queue, writer, bar))
            for i in range(min(prepared.concurrency, max(1, len(self.todo))))
        ]

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


def finish(prepared: PreparedRun, folder: RunFolder, sender: RequestSender, wall: float) -> RunOutcome:
    """End snapshot, summary.json and manifest, then the outcome (module docstring's exit codes)."""
    cfg = prepared.cfg
    with Server(cfg.base_url, cfg.api_key) as server:
        end = prepared.snapshot(server.describe())
        metrics_after = spec_metrics.snapshot(server)
    protocol = folder.record_end(end)
    n_new = len(sender.records) - len(folder.kept)
    metrics = spec_metrics.run_level(prepared.server.metrics_before, metrics_after)
    if metrics is not None and folder.resumed is not None:
        metrics["covers"] = "only the requests this resume sent"
    meta = {
        "arm": cfg.arm,
        "run_id": folder.run_id,
        "model": prepared.model,
        "endpoint": prepared.recorded_url,
        "interrupted": sender.interrupted,
        "refused": sender.refused,
        "wall_s": wall,
        "requests_per_s": (n_new / wall) if wall > 0 else None,
        "overrides": dict(
            cfg.overrides,
            **({"num_examples": cfg.num_examples} if cfg.num_examples else {}),
            **({"repeats": cfg.repeats} if cfg.repeats is not None else {}),
        ),
        "data_drift": prepared.data.data_drift,
        "manifest_changed": bool(protocol),
        "manifest_changes": protocol,
        "resumed": folder.resumed is not None,
        "server_lossy_acceptance": prepared.server.lossy,
        "server_debug_faults": prepared.server.faults,
        "server_deterministic": prepared.server.deterministic,
        "spec_metrics": metrics,
    }
    summary = compute_summary(
        lane_name=prepared.lane.name,
        grader=prepared.lane.grader,
        repeats=prepared.repeats,
        planned_question_ids=[it.question_id for it in prepared.items],
        records=sender.records,
        meta=meta,
        groups=item_groups(prepared.items),
    )
    summary["partial"] = bool(sender.interrupted or sender.refused or summary["n_missing"] > 0)
    if sender.refused:
        summary["accuracy"] = None
    folder.write_summary(summary)
    if sender.refused:
        return RunOutcome(
            folder.path, summary, EXIT_REFUSED, f"refusing to score: {sender.refused}; records kept in {folder.path}"
        )
    if sender.interrupted:
        code = EXIT_SIGINT if sender.interrupted == "SIGINT" else EXIT_SIGTERM
        return RunOutcome(
            folder.path,
            summary,
            code,
            f"interrupted ({sender.interrupted}): partial summary "
            f"written; continue with:\n  {folder.resume_command(prepared.recorded_url)}",
        )
    unfinished = summary["n_errors"] + summary["n_missing"]
    if unfinished:
        kinds = _error_kinds(sender.records)
        return RunOutcome(
            folder.path,
            summary,
            EXIT_ERRORS_REMAIN,
            f"{unfinished} of {summary['n_planned']} planned items have no successful response "
            f"({kinds}); they count as wrong. Retry just those with:\n  "
            f"{folder.resume_command(prepared.recorded_url)}",
        )
    return RunOutcome(folder.path, summary, 0)


def _error_kinds(records: list[Record]) -> str:
    """`APIConnectionError x70, InternalServerError x3`: what the error records of a run were."""
    counts = Counter(r.error.get("type") or "error" for r in records if r.error)
    return ", ".join(f"{kind} x{n}" for kind, n in counts.most_common()) or "no record"
