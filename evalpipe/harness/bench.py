"""Streamed decode-throughput protocol (serving notes section E).

Per request: decode tokens/s = (final completion tokens - tokens in the first streamed event)
/ (time of last event - time of first event), which leaves prefill out. Token counts per event are exact:
the chunk's `token_ids` (we ask for `return_token_ids`) or the difference of cumulative usage
(`stream_options.continuous_usage_stats`). Chunks are never counted: one speculative step can carry
several tokens. A server that gives neither count is refused rather than guessed at.

Input ids come from the server's own tokenizer range (--token-id-range, else its reported vocab_size, else the ids
its /tokenize gives for a probe text); a server that reveals none is refused rather than sent ids it may reject.
Speculative counters from the server's /metrics (vLLM, SGLang) are read before the measured rounds and after them.

Every event time and count is kept in bench.json so the numbers can be recomputed from the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import aiohttp
import numpy as np
from httpx_sse import SSEError

from evalpipe.harness import spec_metrics
from evalpipe.harness.client import (
    CACHE_RESET_PATHS,
    EndpointError,
    Server,
    StreamRefused,
    sse_json,
    streaming_client,
)
from evalpipe.harness.records import BENCH_FILE, write_json
from evalpipe.harness.server_facts import deterministic_mode, find_key

SCHEMA_VERSION = 1


class BenchError(Exception):
    """The bench cannot produce honest numbers (unreachable server, no exact token counts, ...)."""


@dataclass
class BenchConfig:
    base_url: str
    model: Optional[str] = None
    api_key: Optional[str] = None
    input_len: int = 1024  # 1024 + 256 fits the default server's 4096-token context with room to spare
    output_len: int = 256
    rounds: int = 6
    warmup: int = 1
    concurrency: int = 1
    seed: int = 0
    token_id_range: Optional[tuple[int, int]] = None
    flush: bool = True
    timeout_s: float = 600.0
    extra_body: dict = field(default_factory=dict)
    client_processes: int = 1  # processes reading each round's streams (harness/bench_workers.py)


def make_inputs(seed: int, n: int, length: int, low: int, high: int) -> list[list[int]]:
    """n fixed random prompts of `length` token ids in [low, high) from numpy's default_rng(seed)."""
    return np.random.default_rng(seed).integers(low, high, size=(n, length)).tolist()


def inputs_sha256(inputs: list[list[int]]) -> str:
    """sha256 of the compact JSON of the id lists (no spaces), the form recorded in bench.json."""
    return hashlib.sha256(json.dumps(inputs, separators=(",", ":")).encode()).hexdigest()


def decode_rate(events: list[list[float]], final_tokens: Optional[int]) -> Optional[float]:
    """(final tokens - tokens in first event) / (t_last - t_first); None with fewer than two events.

    events: [[t_seconds_since_send, tokens_in_event], ...] in arrival order, content events only.
    """
    if final_tokens is None or len(events) < 2:
        return None
    dt = events[-1][0] - events[0][0]
    if dt <= 0:
        return None
    return (final_tokens - events[0][1]) / dt


def _event_tokens(chunk: dict, prev_cum: Optional[int]) -> tuple[Optional[int], Optional[int], str]:
    """(tokens in this event, cumulative completion tokens after it, source of the count)."""
    choices = chunk.get("choices") or []
    usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
    cum = usage.get("completion_tokens") if usage else None
    ids = [c.get("token_ids") for c in choices if isinstance(c, dict)]
    if ids and all(isinstance(x, list) for x in ids):
        return sum(len(x) for x in ids), cum, "token_ids"
    if cum is not None:
        return cum - (prev_cum or 0), cum, "continuous_usage"
    return None, cum, "none"


async def stream_request(client: aiohttp.ClientSession, url: str, body: dict, headers: Optional[dict] = None) -> dict:
    """One streamed completion (events parsed by client.sse_json); times are perf_counter seconds since the request
    was sent."""
    out: dict[str, Any] = {
        "events": [],
        "error": None,
        "completion_tokens": None,
        "spec": None,
        "count_sources": [],
        "usage_mismatch": False,
        "finish_reason": None,
    }
    t0 = time.perf_counter()
    prev_cum: Optional[int] = None
    try:
        async with contextlib.aclosing(sse_json(client, url, body, headers)) as events:
            async for chunk in events:
                t = time.perf_counter() - t0
                if "error" in chunk and not chunk.get("choices"):
                    out["error"] = {"type": "stream", "status": None, "message": json.dumps(chunk["error"])[:2000]}
                    break
                n, cum, source = _event_tokens(chunk, prev_cum)
                usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
                for c in chunk.get("choices") or []:
                    if isinstance(c, dict):
                        if isinstance(c.get("spec"), dict):
                            out["spec"] = c["spec"]
                        if c.get("finish_reason"):
                            out["finish_reason"] = c["finish_reason"]
                if chunk.get("choices"):
                    if n is None:
                        raise BenchError(
                            "the server's stream chunks carry neither token_ids nor cumulative usage "
                            "(continuous_usage_stats); exact per-event token counts are unavailable"
                        )
                    if source == "token_ids" and cum is not None and prev_cum is not None and cum - prev_cum != n:
                        out["usage_mismatch"] = True
                    if n > 0:
                        out["events"].append([t, n])
                        out["count_sources"].append(source)
                if cum is not None:
                    prev_cum = cum
                if usage and not chunk.get("choices"):
                    out["completion_tokens"] = usage.get("completion_tokens")
        out["total_s"] = time.perf_counter() - t0
    except StreamRefused as exc:
        out["error"] = {"type": "http", "status": exc.status, "message": exc.text}
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, SSEError) as exc:
        out["error"] = {"type": type(exc).__name__, "status": None, "message": str(exc)[:2000]}
    if out["completion_tokens"] is None and prev_cum is not None:
        out["completion_tokens"] = prev_cum
    if out["completion_tokens"] is None and out["events"]:
        out["completion_tokens"] = int(sum(n for _, n in out["events"]))
    return out


# Text whose tokens span a tokenizer's ordinary range (words, digits, punctuation); sent to /tokenize only.
TOKENIZE_PROBE = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May? Weng earns $12 an hour for babysitting; yesterday she did "
    "50 minutes. The quick brown fox jumps over the lazy dog: 0123456789 +-*/=()[]{}<>!?%#@&_~ speculative "
    "decoding, throughput, verification, acceptance, tokenizer, vocabulary, Zürich, naïve, 東京, 😀."
)


def _tokenize_ids(server: Server, model: str) -> Optional[list[int]]:
    """Token ids the server's /tokenize (vLLM, SGLang) gives for the probe text, or None without one."""
    body = Server.json_of(
        server.post("/tokenize", {"model": model, "prompt": TOKENIZE_PROBE, "add_special_tokens": False})
    )
    ids = next(
        (body.get(k) for k in ("tokens", "token_ids", "input_ids") if isinstance(body, dict) and k in body), None
    )
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return ids
    return None


def token_id_range(server: Server, cfg: "BenchConfig", model: str, info: Optional[dict]) -> tuple[int, int, str]:
    """[low, high) of the input ids and where it came from; BenchError when the server's range cannot be known."""
    if cfg.token_id_range:
        low, high = cfg.token_id_range
        return low, high, "--token-id-range"
    vocab = find_key(info, ("vocab_size",))
    if isinstance(vocab, int) and vocab > 8:
        return min(100, vocab // 4), min(vocab, 30000), f"server vocab_size {vocab}"
    ids = _tokenize_ids(server, model)
    if ids:
        return (
            min(ids),
            max(ids) + 1,
            (f"server /tokenize of a probe text: ids {min(ids)}..{max(ids)} ({len(set(ids))} distinct)"),
        )
    raise BenchError(
        "cannot tell which token ids this server accepts: it reports no vocab_size and offers no /tokenize; "
        "pass --token-id-range LOW HIGH with ids from its tokenizer"
    )


def _server_accept_length(info: Optional[dict]) -> Optional[float]:
    value = find_key(info, ("avg_spec_accept_length", "avg_accept_length"))
    return float(value) if isinstance(value, (int, float)) else None


def _median(xs: list[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


class BenchState:
    """What a bench has gathered so far; `assemble` turns it into bench.json, also after an interrupt."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        self.config: dict = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
        self.server: dict = {}
        self.requests: list[dict] = []
        self.rounds: list[dict] = []  # aggregate per round: all completion tokens over the round's wall time
        self.server_accept: list[Optional[float]] = []
        self.metrics_before: Optional[dict] = None  # /metrics speculative counters before the measured rounds
        self.metrics_after: Optional[dict] = None  # ... and after the last measured round that finished

    def assemble(self, partial: bool) -> dict:
        kept = [r for r in self.requests if not r["warmup"] and not r["error"]]

        def values(key: str) -> list[float]:
            return [r[key] for r in kept if isinstance(r.get(key), (int, float))]

        results = {
            name: {"median": _median(values(name)), "values": values(name)}
            for name in ("decode_tokens_per_s", "ttft_s", "total_s")
        }
        acc = values("accept_length")
        agg = [r["aggregate_tokens_per_s"] for r in self.rounds if not r["warmup"] and r["aggregate_tokens_per_s"]]
        results.update(
            accept_length_median=_median(acc),
            accept_length_values=acc,
            server_avg_accept_length_after_each_round=self.server_accept,
            spec_metrics=spec_metrics.run_level(self.metrics_before, self.metrics_after),
            aggregate_tokens_per_s={"median": _median(agg), "values": agg},
            n_kept=len(kept),
            n_errors=sum(1 for r in self.requests if r["error"]),
            n_dropped=sum(1 for r in kept if r["decode_tokens_per_s"] is None),
        )
        from evalpipe.harness.manifest import code_provenance, installed_packages, python_platform

        return {
            "schema_version": SCHEMA_VERSION,
            "kind": "bench",
            "created_at": time.time(),
            "config": self.config,
            "server": self.server,
            "provenance": {"code": code_provenance(), "packages": installed_packages(), "python": python_platform()},
            "partial": partial,
            "results": results,
            "rounds": self.rounds,
            "requests": self.requests,
        }


async def run_bench(
    cfg: BenchConfig, progress: Optional[Callable[[int, int], None]] = None, state: Optional[BenchState] = None
) -> dict:
    """Run warm-up + measured rounds; return the bench.json dict (`state` keeps the pieces if interrupted)."""
    st = state or BenchState(cfg)
    if not 1 <= cfg.client_processes <= cfg.concurrency:
        raise BenchError(f"client_processes must be 1..concurrency ({cfg.concurrency}), not {cfg.client_processes}")
    with Server(cfg.base_url, cfg.api_key, timeout_s=cfg.timeout_s) as server:
        model, inputs, reset_path = _prepare(server, cfg, st)
        if cfg.client_processes > 1:
            from evalpipe.harness.bench_workers import ClientWorkers, WorkerFailed

            try:
                pool = ClientWorkers(cfg.client_processes, stream_request, cfg.api_key, cfg.timeout_s, cfg.concurrency)
                with pool as workers:
                    await _rounds(server, workers.round, cfg, st, model, inputs, reset_path, progress)
            except WorkerFailed as exc:
                raise BenchError(str(exc)) from exc
        else:
            async with streaming_client(cfg.api_key, cfg.timeout_s, cfg.concurrency) as client:

                async def one_process(url: str, bodies: list[dict]) -> tuple[list[dict], float]:
                    start = time.perf_counter()
                    results = await asyncio.gather(*(stream_request(client, url, b) for b in bodies))
                    return list(results), time.perf_counter() - start

                await _rounds(server, one_process, cfg, st, model, inputs, reset_path, progress)
    return st.assemble(partial=False)


def _prepare(server: Server, cfg: BenchConfig, st: BenchState) -> tuple[str, list[list[int]], Optional[str]]:
    """Who serves what, with which token ids and which prefix-cache reset: refused here, before any request."""
    try:
        models = server.models()
    except EndpointError as exc:
        raise BenchError(str(exc)) from exc
    ids = [m["id"] for m in models["data"]]
    model = cfg.model or ids[0]
    if cfg.model and cfg.model not in ids:
        raise BenchError(f"model {cfg.model!r} is not served (served: {ids})")
    limit = next((m.get("max_model_len") for m in models["data"] if isinstance(m, dict) and m.get("id") == model), None)
    if isinstance(limit, int) and cfg.input_len + cfg.output_len > limit:
        raise BenchError(
            f"--input-len {cfg.input_len} + --output-len {cfg.output_len} exceeds the server's "
            f"max_model_len {limit} for {model}: every request would be rejected"
        )
    _, info = server.server_info()
    low, high, range_source = token_id_range(server, cfg, model, info)
    inputs = make_inputs(cfg.seed, cfg.concurrency, cfg.input_len, low, high)
    reset_path = server.reset_prefix_cache() if cfg.flush else None
    st.config.update(
        model=model,
        token_id_range=[low, high],
        token_id_range_source=range_source,
        input_ids_sha256=inputs_sha256(inputs),
        temperature=0.0,
        ignore_eos=True,
        decode_rate_formula="(completion_tokens - first_event_tokens) / (t_last - t_first)",
    )
    st.server = {
        "models": models,
        "server_info": info,
        "deterministic": deterministic_mode(info),  # its batch-invariant mode as it reports it; None: it does not say
        "flush_cache_offered": reset_path is not None,
        "cache_reset_path": reset_path,
        "cache_reset_tried": list(CACHE_RESET_PATHS) if cfg.flush else [],
    }
    return model, inputs, reset_path


async def _rounds(
    server: Server,
    read_round: Callable[[str, list[dict]], Awaitable[tuple[list[dict], float]]],
    cfg: BenchConfig,
    st: BenchState,
    model: str,
    inputs: list[list[int]],
    reset_path: Optional[str],
    progress,
) -> None:
    """Warm-up and measured rounds (`read_round` reads one round's streams: in this process or in workers);
    between rounds (nothing in flight) the cache reset and the /metrics reads."""
    url = f"{cfg.base_url.rstrip('/')}/completions"
    total_rounds = cfg.warmup + cfg.rounds
    for rnd in range(total_rounds):
        if rnd == cfg.warmup:  # the measured rounds start: speculative counters before them
            st.metrics_before = spec_metrics.snapshot(server)
        flushed = server.reset_prefix_cache((reset_path,)) is not None if reset_path else False
        bodies = [
            {
                "model": model,
                "prompt": inputs[slot],
                "max_tokens": cfg.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
                **cfg.extra_body,
            }
            for slot in range(cfg.concurrency)
        ]
        results, wall = await read_round(url, bodies)  # wall: first stream's start to last one's end
        round_tokens = sum(r["completion_tokens"] or 0 for r in results if not r["error"])
        st.rounds.append(
            {
                "round": rnd,
                "warmup": rnd < cfg.warmup,
                "wall_s": wall,
                "completion_tokens": round_tokens,
                "aggregate_tokens_per_s": round_tokens / wall if wall > 0 else None,
            }
        )
        for slot, res in enumerate(results):
            ev = res["events"]
            rate = decode_rate(ev, res["completion_tokens"]) if not res["error"] else None
            spec = res["spec"]
            st.requests.append(
                {
                    "round": rnd,
                    "slot": slot,
                    "warmup": rnd < cfg.warmup,
                    "flushed_before": flushed,
                    "error": res["error"],
                    "finish_reason": res["finish_reason"],
                    "completion_tokens": res["completion_tokens"],
                    "first_event_tokens": ev[0][1] if ev else None,
                    "n_events": len(ev),
                    "t_first": ev[0][0] if ev else None,
                    "t_last": ev[-1][0] if ev else None,
                    "ttft_s": ev[0][0] if ev else None,
                    "total_s": res.get("total_s"),
                    "decode_tokens_per_s": rate,
                    "dropped_reason": None if rate is not None or res["error"] else "fewer than 2 content events",
                    "count_source": sorted(set(res["count_sources"])),
                    "usage_mismatch": res["usage_mismatch"],
                    "accept_length": spec.get("accept_length") if isinstance(spec, dict) else None,
                    "spec": spec,
                    "events": ev,
                }
            )
        st.server_accept.append(_server_accept_length(Server.json_of(server.get("/get_server_info"))))
        if rnd >= cfg.warmup:
            st.metrics_after = spec_metrics.snapshot(server)
        if progress:
            progress(rnd + 1, total_rounds)


def write_bench(result: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / BENCH_FILE, result)
    return out_dir / BENCH_FILE
