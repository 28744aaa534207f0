"""The served GSM8K job's engine half in process (v4-top2 random bf16, the server's build and Engine, prefix cache
on): 1,314 five-shot prompts at C64 with the lane's sampling (T 0, 256 tokens, its stop strings), a new request as
one finishes. Each step is filed by the prompt rows it fed (read from Engine.stats after the step) and the decode
rows it carried; per bucket: steps, wall, prompt rows. In the last run, up to 6 steps that may feed prompt rows are
profiled instead (torch.profiler: kernels launched, the GPU's busy time; their time is the profiler's, left out of
the buckets and reported apart). A warm-up run of the first --warmup prompts compiles the kernels first.

    python .gpu/gsm8k_probe.py OUT DATA [--smoke] [--runs 2] [--examples N] [--warmup 64]
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import torch

from benchmarks.serving import gpu_real_job as rj
from evalpipe.engine.build import build
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.loop import build_engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.lanes.gsm8k import LANE

BUCKETS = (0, 256, 1024, 4096, 8192)


def bucket(rows: int) -> str:
    if rows == 0:
        return "no prompt rows"
    for b in BUCKETS[1:]:
        if rows <= b:
            return f"prompt rows <= {b}"
    return "prompt rows > 8192"


def profiled(engine) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    with profile(activities=acts) as prof:
        a = time.perf_counter()
        engine.step()
        sync()
        wall = time.perf_counter() - a
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels)  # us
    return {"wall_ms": wall * 1e3, "kernels": len(kernels), "gpu_busy_ms": busy / 1e3}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(engine, prompts, params, profile: bool, after: int):
    seqs = [Sequence(prompt=p, params=params) for p in prompts]
    queue = collections.deque(seqs)
    inflight = []
    while queue and len(inflight) < 64:
        inflight.append(queue.popleft())
    engine.submit(list(inflight))
    sync()
    t0 = time.perf_counter()
    by = collections.defaultdict(lambda: [0, 0.0, 0, 0])  # steps, wall, prompt rows, decode rows
    profiles: dict[str, dict] = {}
    steps = tries = profiled_n = 0
    profiled_s = 0.0
    while engine.busy or queue:
        running = engine.scheduler.running
        decoding = sum(1 for s in running if not s.prefilling)
        fed = engine.stats["prefilled_tokens"]
        waiting = engine.scheduler.num_waiting
        if profile and steps > after and tries < 6 and (waiting or any(s.prefilling for s in running)):
            tries += 1
            # a step that will feed prompt rows: profile the first of each bucket (judged after the step)
            a = time.perf_counter()
            rec = profiled(engine)
            taken = time.perf_counter() - a  # the profiler's set-up and event processing too
            rows = engine.stats["prefilled_tokens"] - fed
            key = bucket(rows)
            if key not in profiles:
                profiles[key] = dict(rec, prompt_rows=rows, decode_rows=decoding)
            profiled_s += taken
            steps += 1
            profiled_n += 1
        else:
            a = time.perf_counter()
            engine.step()
            w = time.perf_counter() - a
            rows = engine.stats["prefilled_tokens"] - fed
            key = bucket(rows)
            steps += 1
            b = by[key]
            b[0] += 1
            b[1] += w
            b[2] += rows
            b[3] += decoding
        done = [x for x in inflight if x.status is Status.FINISHED]
        if done:
            inflight = [x for x in inflight if x.status is not Status.FINISHED]
            new = [queue.popleft() for _ in range(min(len(done), len(queue)))]
            inflight += new
            if new:
                engine.submit(new)
    sync()
    wall = time.perf_counter() - t0
    gen = sum(len(s.output) for s in seqs)
    cached = sum(s.cached_tokens for s in seqs)
    print(
        f"  wall {wall:.2f}s ({wall - profiled_s:.2f}s less the {profiled_n} profiled steps), {steps} steps, {gen} "
        f"generated tokens, {sum(map(len, prompts))} prompt tokens of which {cached} cached; unprofiled steps:",
        flush=True,
    )
    for k in sorted(by):
        n, t, r, d = by[k]
        print(
            f"    {k:22s}: {n:5d} steps, {t:7.2f}s, {t / n * 1e3:8.2f} ms/step, {r:8d} prompt rows, "
            f"{d / n:5.1f} decode rows/step",
            flush=True,
        )
    for k in sorted(profiles):
        print(f"    profiled, {k}: {profiles[k]}", flush=True)
    return wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--examples", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=64, help="prompts run once before the measured runs")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument(
        "--groups-per-count", action="store_true", help="attention groups as before padding: one per distinct length"
    )
    a = ap.parse_args()
    if a.groups_per_count:
        from evalpipe.engine import forward_batch

        def one_group_per_count(counts):
            by: dict[int, list[int]] = {}
            for i, c in enumerate(counts):
                by.setdefault(c, []).append(i)
            return list(by.values())

        forward_batch.group_requests = one_group_per_count
    rj.place("gsm8k_probe", a.smoke)
    model_dir = a.out / "v4-top2"
    if not (model_dir / "config.json").exists():  # the same seeded weights as another script's
        rj.write_checkpoint(model_dir, a.smoke)
    max_tokens = 8 if a.smoke else 256
    lane = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, seed=0, stop=("Question", "Assistant:", "<|separator|>")
    )
    items = LANE.load(a.data, False).items
    if a.examples:
        items = items[: a.examples]
    config = EngineConfig(model=str(model_dir), device=rj.DEVICE, dtype=rj.DTYPE, max_batch=64)
    t0 = time.perf_counter()
    engine = build_engine(config, build, lambda c: load_tokenizer(None))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{name}: engine built in {time.perf_counter() - t0:.1f}s, chunk {config.max_tokens_per_step}", flush=True)
    prompts = [engine.tokenizer.encode_prompt(it.prompt) for it in items]
    if a.smoke:
        prompts = [p[-200:] for p in prompts]
    if a.warmup:
        print(f"== warm-up: the first {a.warmup} prompts (the prompt path's kernels compile)", flush=True)
        run(engine, prompts[: a.warmup], lane, profile=False, after=0)
    for i in range(a.runs):
        last = i == a.runs - 1 and not a.no_profile
        print(f"== run {i + 1} (lane sampling){', profiled steps' if last else ''}", flush=True)
        run(engine, prompts, lane, profile=i == a.runs - 1 and not a.no_profile, after=2 if a.smoke else 200)


if __name__ == "__main__":
    main()
