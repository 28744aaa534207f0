"""The repeatability protocol (serving notes section D): one prompt N times at temperature 0, per condition.

Greedy decoding is deterministic only for a fixed batch and kernel path; load, prefix-cache hits, logprob
requests and speculation change the reduction order and can fork outputs. For every fixture and condition
this counts distinct completions out of N, the modal completion's share, where the others leave the mode
(and the logprob gap there when logprobs were recorded), and whether the checkable controls were right.

Conditions: serial; burst (all N concurrently); logprobs (serial, with top-2 logprobs); prefix_fresh
(cache dropped before each request) and prefix_reused (after a priming request) where the server can drop its
prefix cache (/flush_cache, or vLLM's /reset_prefix_cache in dev mode) and reports cached tokens. Every response is
recorded in the run-record JSONL form.

Batch-shape invariance (asked for with `batch_shape`, or one by one): batch_1 sends the fixture alone, batch_8 and
batch_64 send each of its N requests together with 7 or 63 other prompts of the same length limit (recorded as
`<condition>_filler`), all with top-2 logprobs. Besides each condition's own group, the `batch_shape` group pools
the three: its distinct outputs count the outputs that changed with the batch shape, and its first divergence and
logprob gap say where and how close the tokens were.

Seeded batch-shape invariance (`seeded_batch_shape`, or one by one): seeded_batch_1, seeded_batch_8 and
seeded_batch_64 send the same, but at temperature SEEDED_TEMPERATURE with the fixture's N requests all seeded
SEEDED_SEED (the fillers with other seeds), so on a server whose sampled tokens depend only on the prompt and the
seed (evalpipe serve --deterministic; what vLLM's VLLM_BATCH_INVARIANT and SGLang's deterministic mode promise) all
of them are one completion; the `seeded_batch_shape` group pools the three. Controls are not graded there (a sample
at T = 1 need not be right).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from evalpipe.harness.agreement import first_divergence, logprob_gap
from evalpipe.harness.client import CACHE_RESET_MISSING, CACHE_RESET_PATHS, Server, openai_client, send
from evalpipe.harness.records import (
    MANIFEST_FILE,
    REPEAT_FILE,
    REQUIRED_KEYS,
    RESPONSES_FILE,
    SCHEMA_VERSION,
    RecordWriter,
    response_fields,
    write_json,
)
from evalpipe.harness.server_facts import deterministic_mode
from evalpipe.lanes.repeat_fixtures import Fixture, fixtures_sha256
from evalpipe.redact import redact_text

CONDITIONS = ("serial", "burst", "logprobs", "prefix_fresh", "prefix_reused")
BATCH_SIZES = {"batch_1": 1, "batch_8": 8, "batch_64": 64}  # opt-in: `batch_shape` asks for all three
BATCH_SHAPE = "batch_shape"
SEEDED_BATCH_SIZES = {"seeded_batch_1": 1, "seeded_batch_8": 8, "seeded_batch_64": 64}  # opt-in, sampled
SEEDED_BATCH_SHAPE = "seeded_batch_shape"
SEEDED_TEMPERATURE = 1.0
SEEDED_SEED = 46  # the fixture's; filler j sends SEEDED_SEED + 1 + j
LANE = "repeat"
TOP_LOGPROBS = 2
MAX_RETRIES, RETRY_BACKOFF_S = 2, 0.5  # harness/client.py's policy; a repeat's requests are short


@dataclass
class RepeatConfig:
    base_url: str
    fixtures: list[Fixture]
    repeats: int = 8
    conditions: tuple[str, ...] = CONDITIONS
    model: Optional[str] = None
    api_key: Optional[str] = None
    token_ids: bool = True
    timeout_s: float = 300.0
    arm: str = "repeat"
    out_dir: Path = Path("results")
    extra_body: dict = field(default_factory=dict)


def output_key(rec: dict) -> Any:
    """What "identical" means: the token ids when the server returned them, else the text."""
    ids = rec.get("output_token_ids")
    return ("ids", tuple(ids)) if isinstance(ids, list) else ("text", rec.get("response_text"))


def cached_tokens(usage: Optional[dict]) -> Optional[int]:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return usage.get("cached_tokens") if isinstance(usage.get("cached_tokens"), int) else None


def shape_size(condition: str) -> int:
    """The batch a batch-shape condition (seeded or not) sends its fixture in; 0 for any other condition."""
    return BATCH_SIZES.get(condition) or SEEDED_BATCH_SIZES.get(condition) or 0


def summarize_group(fixture: Fixture, recs: list[dict], graded: bool = True) -> dict:
    """Distinct completions, modal share, divergence from the mode and (`graded`) control correctness for one
    group."""
    ok = [r for r in recs if not r.get("error")]
    counts = Counter(output_key(r) for r in ok)
    out: dict[str, Any] = {"n": len(recs), "n_errors": len(recs) - len(ok), "distinct": len(counts)}
    if not ok:
        return out
    mode_key, mode_n = counts.most_common(1)[0]
    mode_rec = next(r for r in ok if output_key(r) == mode_key)

    def seq(r: dict) -> list[str]:
        return list(output_key(r)[1] or "")

    divergences, gaps = [], []
    for key in counts:
        if key == mode_key:
            continue
        other = next(r for r in ok if output_key(r) == key)
        pos = first_divergence(seq(mode_rec), seq(other))
        divergences.append(pos)
        if output_key(mode_rec)[0] == "ids" and pos is not None:
            g = logprob_gap(mode_rec.get("logprobs"), other.get("logprobs"), pos)
            if g and g.get("gap") is not None:
                gaps.append({"position": pos, **g})
    out.update(
        modal_share=mode_n / len(ok),
        mode_basis="token_ids" if mode_key[0] == "ids" else "text",
        mode_text=mode_rec.get("response_text"),
        first_divergence_from_mode=min(divergences) if divergences else None,
        divergence_positions=sorted(divergences),
        logprob_gap_at_first_divergence=(min(gaps, key=lambda g: g["position"])["gap"] if gaps else None),
        logprob_gaps=gaps,
        cached_tokens=[cached_tokens(r.get("usage")) for r in ok],
    )
    if fixture.kind != "open" and graded:
        grades = [r.get("correct") for r in ok]
        out.update(
            control_correct_share=sum(bool(g) for g in grades) / len(ok),
            mode_correct=bool(mode_rec.get("correct")),
            expected=fixture.expected,
        )
    return out


class RepeatRun:
    """Sends the requests, writes the records, and builds repeat.json."""

    def __init__(self, cfg: RepeatConfig, progress: Optional[Callable[[int], None]] = None):
        self.cfg = cfg
        self.progress = progress
        self.seq = 0
        self.records: list[dict] = []
        self.run_dir: Optional[Path] = None
        self.conditions: list[str] = []
        self.cache_reset_path: Optional[str] = None
        self.server = Server(cfg.base_url, cfg.api_key)
        self.client = openai_client(
            cfg.base_url,
            cfg.api_key,
            cfg.timeout_s,
            connections=max(cfg.repeats, *(shape_size(c) or 1 for c in cfg.conditions)),
        )

    def flush(self) -> bool:
        """Drop the server's prefix cache through the route it offers (probed once, then that one only)."""
        path = self.server.reset_prefix_cache((self.cache_reset_path,) if self.cache_reset_path else CACHE_RESET_PATHS)
        if self.cache_reset_path is None:
            self.cache_reset_path = path
        return path is not None

    async def one(
        self, fixture: Fixture, condition: str, index: int, *, logprobs: bool, seed: Optional[int] = None
    ) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": fixture.prompt,
            "max_tokens": fixture.max_tokens,
            "temperature": 0.0 if seed is None else SEEDED_TEMPERATURE,
            "top_p": 1.0,
        }
        if seed is not None:
            body["seed"] = seed
        extra = dict(self.cfg.extra_body)
        if self.cfg.token_ids:
            extra["return_token_ids"] = True
        if logprobs:
            body["logprobs"] = TOP_LOGPROBS
        self.seq += 1
        rec = {k: None for k in REQUIRED_KEYS}
        rec.update(
            schema_version=SCHEMA_VERSION,
            run_id=self.run_id,
            arm=self.cfg.arm,
            lane=LANE,
            question_id=f"{fixture.id}/{condition}",
            repeat_index=index,
            request_seq=self.seq,
            endpoint=redact_text(self.cfg.base_url) + "/completions",
            model=self.model,
            server_deterministic=self.server_facts["deterministic"],
            prompt_sha256=hashlib.sha256(fixture.prompt.encode()).hexdigest(),
            request={**body, **extra},
            fixture=fixture.id,
            condition=condition,
            expected_answer=fixture.expected,
        )
        reply = await send(
            self.client,
            "/completions",
            rec["request"],
            chat=False,
            max_retries=MAX_RETRIES,
            backoff_s=RETRY_BACKOFF_S,
            secrets=[self.cfg.api_key or ""],
        )
        rec.update(response_fields(reply, chat=False), created_at=time.time())
        if reply.data is not None and seed is not None:
            rec.update(grade_status="ungraded")
        elif reply.data is not None:
            answer, correct = fixture.grade(rec["response_text"])
            rec.update(
                extracted_answer=answer, correct=correct, grade_status="ok" if fixture.kind != "open" else "ungraded"
            )
        else:
            rec.update(correct=False, grade_status="request_error")
        self.writer.write(rec)
        self.records.append(rec)
        if self.progress:
            self.progress(1)
        return rec

    async def condition(self, fixture: Fixture, condition: str) -> list[dict]:
        n = self.cfg.repeats
        if shape_size(condition):
            seeded = condition in SEEDED_BATCH_SIZES
            out = []
            for i in range(n):
                fillers = [
                    self.one(
                        filler, f"{condition}_filler", i, logprobs=True, seed=SEEDED_SEED + 1 + j if seeded else None
                    )
                    for j, filler in enumerate(self.fillers(fixture, shape_size(condition) - 1))
                ]
                own = self.one(fixture, condition, i, logprobs=True, seed=SEEDED_SEED if seeded else None)
                done = await asyncio.gather(own, *fillers)
                out.append(done[0])
            return out
        if condition == "burst":
            return list(await asyncio.gather(*(self.one(fixture, condition, i, logprobs=False) for i in range(n))))
        out = []
        if condition == "prefix_reused":
            await self.one(fixture, "prefix_reused_priming", 0, logprobs=False)
        for i in range(n):
            if condition == "prefix_fresh":
                self.flush()
            out.append(await self.one(fixture, condition, i, logprobs=condition == "logprobs"))
        return out

    def fillers(self, fixture: Fixture, count: int) -> list[Fixture]:
        """`count` other prompts for the fixture's batch: the other fixtures' prompts, numbered so that none is
        identical to another, with the fixture's own max_tokens (so they stay in flight while it decodes)."""
        others = [f.prompt for f in self.cfg.fixtures if f.id != fixture.id] or [fixture.prompt]
        return [
            dataclasses.replace(
                fixture,
                id=f"{fixture.id}-filler-{j}",
                kind="open",
                expected=None,
                extract=None,
                prompt=f"({j + 1}) {others[j % len(others)]}",
            )
            for j in range(count)
        ]

    async def run(self) -> dict:
        cfg = self.cfg
        ids = [m["id"] for m in self.server.models()["data"]]
        if cfg.model and cfg.model not in ids:
            raise RepeatError(f"model {cfg.model!r} is not served (served: {ids})")
        self.model = cfg.model or ids[0]
        info = self.server.server_info()[1]
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.run_id = f"{cfg.arm}-{stamp}-{hashlib.sha256(str(time.time()).encode()).hexdigest()[:6]}"
        self.run_dir = Path(cfg.out_dir) / LANE / self.run_id
        self.run_dir.mkdir(parents=True, exist_ok=False)
        flush_offered = self.flush()
        self.server_facts = {
            "models": ids,
            "server_info": info,
            "deterministic": deterministic_mode(info),  # read from the server's own report; None: it does not say
            "flush_cache_offered": flush_offered,
            "cache_reset_path": self.cache_reset_path,
            "reports_cached_tokens": None,
        }
        self.conditions: list[str] = []
        self.skipped: dict[str, str] = {}
        probe = cfg.fixtures[0]
        self.writer = RecordWriter(self.run_dir / RESPONSES_FILE)
        try:
            # cached-token reporting: ask twice for the same prompt and look at the usage block
            if {"prefix_fresh", "prefix_reused"} & set(cfg.conditions):
                first = await self.one(probe, "cache_probe", 0, logprobs=False)
                second = await self.one(probe, "cache_probe", 1, logprobs=False)
                self.server_facts["reports_cached_tokens"] = (
                    cached_tokens(second.get("usage")) is not None or cached_tokens(first.get("usage")) is not None
                )
            for c in cfg.conditions:
                if c in ("prefix_fresh", "prefix_reused") and not (
                    flush_offered and self.server_facts["reports_cached_tokens"]
                ):
                    self.skipped[c] = (
                        CACHE_RESET_MISSING
                        if not flush_offered
                        else "the server reports no cached_tokens in usage (vLLM: start it with "
                        "--enable-prompt-tokens-details)"
                    )
                    continue
                self.conditions.append(c)
            for fx in cfg.fixtures:
                for c in self.conditions:
                    await self.condition(fx, c)
        finally:
            self.writer.close()
            self.server.close()
            await self.client.close()
        return self.write_result(partial=False)

    def write_result(self, partial: bool) -> dict:
        """Build repeat.json from the records alone (so an interrupted run still gets one) and write it."""
        from evalpipe.harness.manifest import code_provenance, installed_packages, python_platform

        cfg = self.cfg
        groups: dict[str, dict[str, dict]] = {}
        for fx in cfg.fixtures:
            for c in self.conditions:
                recs = [r for r in self.records if r.get("fixture") == fx.id and r.get("condition") == c]
                if recs:
                    groups.setdefault(fx.id, {})[c] = summarize_group(fx, recs, graded=c not in SEEDED_BATCH_SIZES)
            for pooled_name, sizes in ((BATCH_SHAPE, BATCH_SIZES), (SEEDED_BATCH_SHAPE, SEEDED_BATCH_SIZES)):
                shapes = [c for c in self.conditions if c in sizes]
                pooled = [r for r in self.records if r.get("fixture") == fx.id and r.get("condition") in shapes]
                if len(shapes) > 1 and pooled:
                    groups.setdefault(fx.id, {})[pooled_name] = {
                        **summarize_group(fx, pooled, graded=pooled_name == BATCH_SHAPE),
                        "conditions": shapes,
                        "distinct_by_condition": {
                            c: groups[fx.id][c]["distinct"] for c in shapes if c in groups[fx.id]
                        },
                    }
        result = {
            "schema_version": SCHEMA_VERSION,
            "kind": "repeat",
            "run_id": self.run_id,
            "arm": cfg.arm,
            "partial": partial,
            "config": {
                "base_url": redact_text(cfg.base_url),
                "model": self.model,
                "repeats": cfg.repeats,
                "conditions": list(self.conditions),
                "conditions_skipped": self.skipped,
                "token_ids": cfg.token_ids,
                "temperature": 0.0,
                **(
                    {"seeded": {"temperature": SEEDED_TEMPERATURE, "seed": SEEDED_SEED}}
                    if set(self.conditions) & set(SEEDED_BATCH_SIZES)
                    else {}
                ),
                "top_logprobs": TOP_LOGPROBS,
                "fixtures": [f.describe() for f in cfg.fixtures],
                "fixtures_sha256": fixtures_sha256(cfg.fixtures),
            },
            "server": self.server_facts,
            "groups": groups,
            "n_records": len(self.records),
            "n_errors": sum(1 for r in self.records if r.get("error")),
        }
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "run_id": self.run_id,
            "arm": cfg.arm,
            "lane": LANE,
            "created_at": time.time(),
            "config": result["config"],
            "server": result["server"],
            "code": code_provenance(),
            "packages": installed_packages(),
            "python": python_platform(),
        }
        write_json(self.run_dir / MANIFEST_FILE, manifest)
        write_json(self.run_dir / REPEAT_FILE, result)
        return result


class RepeatError(Exception):
    """The protocol cannot run (no model, wrong model)."""


def planned_requests(cfg: RepeatConfig) -> int:
    """Upper bound for the progress bar: probes + N per fixture and condition + one priming per fixture."""
    per_fx = cfg.repeats * sum(shape_size(c) or 1 for c in cfg.conditions) + ("prefix_reused" in cfg.conditions)
    probes = 2 if {"prefix_fresh", "prefix_reused"} & set(cfg.conditions) else 0
    return probes + per_fx * len(cfg.fixtures)
