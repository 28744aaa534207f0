"""Gate `soak`: C streamed requests in flight for `--soak-duration` seconds, with zero failures and zero hangs.

Each of C workers sends skill prompts (arithmetic, copy, short retrieval; greedy and sampled) back to back, streamed
and read to `[DONE]`. Counted: failures (an HTTP status, a transport error, a stream without [DONE] or finish
reason), hangs (no event for `--hang-timeout` seconds; the request is then abandoned) and hits of the output cap
(finish_reason "length" at `--soak-max-tokens`: reported, not a failure). Sampled every `--sample-every` seconds:
this host's MemAvailable (/proc/meminfo) and the server's resident memory, read from /proc when the server runs
on this host (its pid from /get_server_info), else the peak RSS the server reports.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from evalpipe.console import make_console
from evalpipe.harness.client import Server
from evalpipe.harness.server_facts import find_key
from evalpipe.qualify.core import Endpoint, GateResult, check, exchange
from evalpipe.skills import arith, copy_text
from evalpipe.skills import retrieval as needles

LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def mem_available_mb() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def rss_mb(pid: Optional[int]) -> Optional[float]:
    if not isinstance(pid, int):
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def server_pid(ep: Endpoint) -> Optional[int]:
    """The server's pid when it runs on this host (a loopback address and a pid it reports that exists here)."""
    if urlparse(ep.base_url).hostname not in LOCAL_HOSTS:
        return None
    pid = find_key(ep.info, ("pid",))
    return pid if isinstance(pid, int) and rss_mb(pid) is not None else None


def reported_rss_mb(ep: Endpoint) -> Optional[float]:
    with Server(ep.base_url, ep.cfg.api_key) as server:
        _, info = server.server_info()
    value = find_key(info, ("peak_rss_mb", "rss_mb"))
    return float(value) if isinstance(value, (int, float)) else None


def stderr_console():
    return make_console(stderr=True)


def prompt(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.4:
        return arith.generate(rng).prompt
    if kind < 0.8:
        return copy_text.generate(rng).prompt
    return needles.generate(rng, after=rng.randint(0, 200), before=rng.randint(0, 300)).prompt


async def run(ep: Endpoint) -> GateResult:
    cfg = ep.cfg
    result = GateResult("soak")
    t0 = time.perf_counter()
    deadline = time.monotonic() + cfg.soak_s
    pid = server_pid(ep)
    samples: list[dict] = []
    stop = asyncio.Event()
    side = [asyncio.create_task(_sample_memory(ep, pid, t0, samples, stop))]
    if cfg.progress:
        side.append(asyncio.create_task(_show_progress(cfg.soak_s, t0, result.records, stop)))
    await asyncio.gather(*(_worker(ep, w, deadline, result.records) for w in range(cfg.concurrency)))
    stop.set()
    await asyncio.gather(*side)
    result.notes = _notes(cfg, pid, result.records, samples)
    result.wall_s = time.perf_counter() - t0
    return result


async def _wait(stop: asyncio.Event, seconds: float) -> None:
    """Sleeps `seconds`, returning early when `stop` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        pass


async def _sample_memory(ep: Endpoint, pid: Optional[int], t0: float, samples: list[dict], stop: asyncio.Event) -> None:
    """Appends a memory sample to `samples` every `--sample-every` seconds until `stop`."""
    while not stop.is_set():
        rss = rss_mb(pid) if pid is not None else await asyncio.to_thread(reported_rss_mb, ep)
        samples.append(
            {
                "t_s": round(time.perf_counter() - t0, 2),
                "mem_available_mb": mem_available_mb(),
                "server_rss_mb": rss,
            }
        )
        await _wait(stop, ep.cfg.sample_every_s)


async def _worker(ep: Endpoint, w: int, deadline: float, records: list) -> None:
    """Worker w: streamed requests back to back until `deadline`, each exchange appended to `records`."""
    cfg = ep.cfg
    rng = random.Random(f"qualify|soak|{w}")
    i = 0
    while time.monotonic() < deadline:
        sampled = rng.random() < 0.3
        body = ep.body(
            prompt=prompt(rng),
            max_tokens=cfg.soak_max_tokens,
            temperature=0.8 if sampled else 0.0,
            seed=rng.randint(0, 1 << 30),
            return_token_ids=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        out = await ep.stream(body, chat=False, hang_s=cfg.hang_s)
        checks = [out.transport_check(), check("no hang", not out.hung, f"longest gap {out.max_gap_s or 0:.2f} s")]
        records.append(
            exchange(f"worker {w} #{i}", "soak", body, out, checks, output_cap_hit=out.finish_reason == "length")
        )
        i += 1


async def _show_progress(total_s: float, t0: float, records: list, stop: asyncio.Event) -> None:
    """A time bar with the request count (stderr; rich draws nothing when it is not a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("soak"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
        TextColumn("{task.fields[n]} requests"),
        TimeRemainingColumn(),
        console=stderr_console(),
        transient=True,
    ) as bar:
        task = bar.add_task("soak", total=total_s, n=0)
        while not stop.is_set():
            bar.update(task, completed=min(total_s, time.perf_counter() - t0), n=len(records))
            await _wait(stop, 0.5)


def _notes(cfg, pid: Optional[int], records: list, samples: list[dict]) -> dict:
    """The gate's counts and memory summary."""
    mem = [s["mem_available_mb"] for s in samples if s["mem_available_mb"] is not None]
    rss = [s["server_rss_mb"] for s in samples if s["server_rss_mb"] is not None]
    return {
        "duration_s": cfg.soak_s,
        "concurrency": cfg.concurrency,
        "hang_timeout_s": cfg.hang_s,
        "failures": sum(not r["ok"] and not r.get("hung") for r in records),
        "hangs": sum(bool(r.get("hung")) for r in records),
        "output_cap_hits": sum(bool(r.get("output_cap_hit")) for r in records),
        "max_event_gap_s": max((r.get("max_gap_s") or 0.0 for r in records), default=None),
        "mem_available_mb": {"first": mem[0], "min": min(mem), "last": mem[-1]} if mem else None,
        "server_rss_mb": {
            "source": f"/proc/{pid}" if pid is not None else "server report (peak)",
            "first": rss[0],
            "max": max(rss),
            "last": rss[-1],
        }
        if rss
        else None,
        "samples": samples,
    }
