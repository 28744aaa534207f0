"""The served GSM8K job's engine half in process (v4-top2 random bf16, the server's build and Engine, prefix cache
on): 1,314 five-shot prompts at C64 with the lane's sampling (T 0, 256 tokens, its stop strings), then the same
with no stop strings and ignore_eos. Per step: wall, decode rows, prompt rows; the time in steps with prompt chunks
vs pure decode steps by batch size; a cProfile of the 200 steps from step 2,000 of the first run. With a third
argument (comma-separated prefill delay factors, e.g. 0,1,0,1): one engine per factor, a 256-prompt warm-up on the
first, then the lane-sampling run on each."""

from __future__ import annotations

import collections
import cProfile
import io
import pstats
import sys
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


def run(engine, prompts, params, profile_at=None):
    seqs = [Sequence(prompt=p, params=params) for p in prompts]
    queue = collections.deque(seqs)
    inflight = []  # 64 in flight, a new one as one finishes: the client's C64
    while queue and len(inflight) < 64:
        inflight.append(queue.popleft())
    engine.submit(list(inflight))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = []
    prof = None
    while engine.busy or queue:
        running = list(engine.scheduler.running)
        prefilling = sum(1 for s in running if s.prefilling)
        decoding = len(running) - prefilling
        if profile_at is not None and len(steps) == profile_at:
            prof = cProfile.Profile()
            prof.enable()
        if prof is not None and len(steps) == profile_at + 200:
            prof.disable()
        a = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - a, decoding, prefilling))
        done = [x for x in inflight if x.status is Status.FINISHED]
        if done:
            inflight = [x for x in inflight if x.status is not Status.FINISHED]
            new = [queue.popleft() for _ in range(min(len(done), len(queue)))]
            inflight += new
            if new:
                engine.submit(new)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    gen = sum(len(s.output) for s in seqs)
    by = collections.defaultdict(lambda: [0, 0.0])
    for w, d, p in steps:
        key = "with prompt rows" if p else f"decode only, {min(64, (d + 15) // 16 * 16)} rows"
        by[key][0] += 1
        by[key][1] += w
    print(f"  wall {wall:.2f}s, {len(steps)} steps, {gen} generated tokens ({gen / wall:.0f} tok/s)")
    for k in sorted(by):
        n, t = by[k]
        print(f"    {k:28s}: {n:5d} steps, {t:7.2f}s, {t / n * 1e3:7.2f} ms/step")
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        print("  cProfile of 200 steps from step", profile_at)
        print("\n".join("    " + ln for ln in buf.getvalue().splitlines()[:40]))
    return wall


def main():
    out = Path(sys.argv[1])
    data = Path(sys.argv[2])
    model_dir = out / "v4-top2"
    rj.write_checkpoint(model_dir, False)
    delays = [float(x) for x in (sys.argv[3] if len(sys.argv) > 3 else "").split(",") if x]
    lane = SamplingParams(max_tokens=256, temperature=0.0, seed=0, stop=("Question", "Assistant:", "<|separator|>"))
    free = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    items = LANE.load(data, False).items
    for i, delay in enumerate(delays or [0.0]):
        config = EngineConfig(
            model=str(model_dir), device="cuda", dtype="bfloat16", max_batch=64, prefill_delay_factor=delay
        )
        t0 = time.perf_counter()
        engine = build_engine(config, build, lambda c: load_tokenizer(None))
        print(
            f"{torch.cuda.get_device_name()}: engine built in {time.perf_counter() - t0:.1f}s, chunk "
            f"{config.max_tokens_per_step}, prefill delay factor {delay}",
            flush=True,
        )
        prompts = [engine.tokenizer.encode_prompt(it.prompt) for it in items]
        if not delays:
            print(f"{len(prompts)} prompts, {sum(map(len, prompts))} tokens", flush=True)
            for label, params in (
                ("lane sampling", lane),
                ("no stops, ignore_eos", free),
                ("lane sampling again", lane),
            ):
                print(f"== {label}", flush=True)
                run(engine, prompts, params, profile_at=2000 if label == "lane sampling" else None)
            return
        if i == 0:
            print("== warm-up (256 prompts)", flush=True)
            run(engine, prompts[:256], lane)
        print(f"== lane sampling, prefill delay factor {delay}", flush=True)
        run(engine, prompts, lane)
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
