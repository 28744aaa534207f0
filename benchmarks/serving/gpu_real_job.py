"""The real job on one GPU in one run: five-shot GSM8K through `evalpipe serve` and `evalpipe run` (prefix
cache on vs off), decode and prefill rates, and where a step's time goes, all on the v4-top2 checkpoint.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python -m benchmarks.serving.gpu_real_job --out $OUT --data-dir DIR \
        [--stages engine,targets,http] [--gsm8k-examples 1314] [--serve-args "..."] [--bench-client-processes N]

The checkpoint is `benchmarks/serving/gpu_serving.py`'s v4-top2 (2.11 B parameters, random bf16 weights), written once.

Stages:
- `engine`, in process, on the runner the server builds (`build_runner`: CUDA graphs for every batch bucket up to
  --max-batch): for batch 1, 16 and 64, with the overlap schedule off and on, the steady decode step's wall time
  beside its graph replay's device time (what is left is exposed host work), the kernels (torch.profiler: every
  one at batch 1, the largest at batch 64) and host functions (cProfile) of the batch-1 and batch-64 steps with
  the overlap schedule on; the launch floor (device time per kernel of a captured graph of one-element adds); then
  the prefill rate at several chunk sizes (`--max-tokens-per-step`) with each chunk's kernel profile.
- `targets`: batch 1 against the weight-read limit and against transformers `generate` on the same checkpoint
  (the serving-speed targets), and `benchmarks/kernels/kernels_gpu.py --ops c2,candidate` (the two kernel targets).
- `http`, through real processes: `evalpipe serve --device cuda --dtype bfloat16 --max-batch 64` with the prefix
  cache on, `evalpipe bench` at concurrency 1, 16 and 64 (input 128, output 256), `evalpipe run gsm8k
  --concurrency 64 --max-tokens 256`; then a fresh server with `--prefix-cache off` and the same gsm8k run; then
  one with `--overlap-schedule off` and the bench at concurrency 1 and 64; then one with `--stream-interval 4`
  and the bench at 64 (events of 4 tokens: the HTTP side's share of the gap); then the cache-on gsm8k run with
  `--prefill-delay-factor 1` (`--delay-factor`).

Every number is printed as a table at the end and written to `OUT/gpu_real_job.json`; the logs, run folders and
bench.json files go into `OUT/gpu_real_job_files.tgz` (one archive: the device machine returns few files).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import gpu_bench
from benchmarks.serving.gpu_serving import (
    bench_config,
    copy_bandwidth,
    count_kernels,
    hf_generate_arm,
    random_state,
    weight_bytes,
)
from evalpipe.engine.engine import Engine
from evalpipe.engine.model.config import load_config
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]

DEVICE = "cuda"  # --smoke: cpu, the tiny config, float32 (a dry run of the script's logic)
DTYPE = "bfloat16"
BENCH_LENS = ("128", "256")  # evalpipe bench --input-len, --output-len (--smoke: 32, 16)
GSM8K_MAX_TOKENS = "256"  # evalpipe run gsm8k --max-tokens (--smoke: 8)
# --smoke: the engine stage at batch 1 and 2, 16-token contexts, 4 decode steps, 64-token prompts; the http stage's
# cache-on and cache-off arms only, each with one bench at concurrency 2 (every step of the arm loop, two boots)
SMOKE = False


def serve_base() -> list[str]:
    """The served configuration; `--log-level info` adds the engine's own rates to each server's log (every 10 s of
    work: steps, of them overlapped, steps with prompt chunks and their rows, time per loop beside Engine.step's)."""
    return ["--device", DEVICE, "--dtype", DTYPE, "--max-batch", "64", "--log-level", "info"]


def place(script: str, smoke: bool) -> tuple[str, str] | None:
    """(device, dtype) of a GPU script's run: the CPU dry run's with --smoke (also set here, for write_checkpoint
    and decode_batch), else CUDA's; None, after saying why, when there is no CUDA device."""
    global DEVICE, DTYPE
    if smoke:
        DEVICE, DTYPE = "cpu", "float32"
    elif not torch.cuda.is_available():
        print(f"{script}: no CUDA device (--smoke runs a CPU dry run)", file=sys.stderr)
        return None
    return DEVICE, DTYPE


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(folder: Path, smoke: bool) -> int:
    from evalpipe.engine.model.weights import save_checkpoint

    cfg = bench_config(smoke, "v4-top2")
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], 4096)  # five-shot GSM8K prompts
    config = load_config(cfg)
    state = random_state(config, DEVICE, getattr(torch, DTYPE))
    params = sum(t.numel() for t in state.values())
    save_checkpoint(config, {k: v.cpu() for k, v in state.items()}, folder)
    del state
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return params


# ---- engine stage --------------------------------------------------------------------------------------------


def server_runner(model_dir: Path, max_batch: int = 64):
    from evalpipe.engine.build import build_runner
    from evalpipe.engine.config import EngineConfig

    settings = EngineConfig(model=str(model_dir), device=DEVICE, dtype=DTYPE, max_batch=max_batch, prefix_cache="off")
    t0 = time.perf_counter()
    runner = build_runner(settings)
    return runner, time.perf_counter() - t0


def replay_us(step, reps: int = 20) -> float:
    """Device time of one replay of a captured step (nan on the CPU dry run, where nothing is captured)."""
    if step is None or step.graph is None:
        return float("nan")
    return gpu_bench.replay_us(step.graph, reps)


def decode_batch(
    runner,
    tokenizer,
    batch: int,
    prompt_len: int = 128,
    new_tokens: int = 64,
    overlap: bool = True,
    profile: bool = False,
) -> dict:
    """`batch` greedy sequences prefilled first, then steady decode steps timed one by one (wall, host clock).
    With the overlap schedule a step queues the next forward and then settles the previous one, so its wall time is
    the larger of device and host time."""
    engine = Engine(runner, tokenizer, max_batch=64, max_tokens_per_step=8192, overlap=overlap)
    gen = torch.Generator().manual_seed(batch)
    seqs = [
        Sequence(
            prompt=torch.randint(16, 272, (prompt_len,), generator=gen).tolist(),
            params=SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True),
        )
        for _ in range(batch)
    ]
    engine.submit(seqs)
    while any(s.prefilling or s.status is Status.WAITING for s in seqs):
        engine.step()
    sync()
    walls = []
    for _ in range(new_tokens // 2):
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
    step = runner.step_for(batch, 1) if hasattr(runner, "step_for") else None
    # batch 1: every kernel (where its fixed small kernels go); batch 64: the largest
    kernels = count_kernels(engine.step, top=200 if batch == 1 else 12) if profile else None
    host = None
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(8):
            engine.step()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        host = s.getvalue()
    while any(x.status is not Status.FINISHED for x in seqs):
        engine.step()
    wall = statistics.median(walls) * 1e6
    dev = replay_us(step)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "overlap": engine.overlap,
        "bucket": step.B if step else None,
        "step_wall_us": round(wall, 1),
        "replay_us": round(dev, 1),
        "host_us": round(wall - dev, 1),
        "tok_s": round(batch / wall * 1e6, 1),
        "tok_s_if_device_only": round(batch / dev * 1e6, 1),
        "kernels": kernels,
        "host_profile": host,
    }


def launch_floor_us(nodes: int = 256) -> float | None:
    """Device time per kernel of a captured graph of `nodes` one-element adds: what any launch in a replayed step
    costs however little it does (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    x = torch.zeros(1, device="cuda")
    x.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1)
    return round(gpu_bench.replay_us(graph, 20) / nodes, 3)


def mixed_step(runner, tokenizer, batch: int = 32, chunk_rows: int = 480) -> dict:
    """A step that also carries a prompt chunk (what a busy server runs while requests keep arriving): `batch`
    decoding sequences plus one new `chunk_rows`-token prompt, against the pure decode step of the same batch."""
    engine = Engine(runner, tokenizer, max_batch=64, max_tokens_per_step=8192)
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seqs = [
        Sequence(prompt=torch.randint(16, 272, (128,), generator=gen).tolist(), params=params) for _ in range(batch)
    ]
    engine.submit(seqs)
    engine.step()
    for _ in range(3):
        engine.step()
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        engine.step()
    sync()
    pure = (time.perf_counter() - t0) / 5
    new = Sequence(prompt=torch.randint(16, 272, (chunk_rows,), generator=gen).tolist(), params=params)
    engine.submit([new])
    sync()
    t0 = time.perf_counter()
    kernels = count_kernels(engine.step, top=8)
    sync()
    mixed = time.perf_counter() - t0
    while any(x.status is not Status.FINISHED for x in seqs + [new]):
        engine.step()
    return {
        "batch": batch,
        "chunk_rows": chunk_rows,
        "pure_decode_step_ms": round(pure * 1e3, 2),
        "mixed_step_ms": round(mixed * 1e3, 2),
        "kernels": kernels,
    }


def prefill_rate(runner, tokenizer, chunk: int, n_seqs: int, prompt_len: int = 3500) -> dict:
    """n_seqs prompts of prompt_len random ids, one token each, at `chunk` rows per step: prompt tokens/s."""
    engine = Engine(runner, tokenizer, max_batch=64, max_tokens_per_step=chunk)
    gen = torch.Generator().manual_seed(chunk)
    seqs = [
        Sequence(
            prompt=torch.randint(16, 272, (prompt_len,), generator=gen).tolist(),
            params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        for _ in range(n_seqs)
    ]
    engine.submit(seqs)
    sync()
    t0 = time.perf_counter()
    steps = 0
    while any(s.status is not Status.FINISHED for s in seqs):
        engine.step()
        steps += 1
    sync()
    wall = time.perf_counter() - t0
    # one more chunk, profiled: a fresh prompt's first `chunk` rows
    probe = Sequence(
        prompt=torch.randint(16, 272, (min(chunk, prompt_len) + 1,), generator=gen).tolist(),
        params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    )
    engine.submit([probe])
    t1 = time.perf_counter()
    kernels = count_kernels(engine.step, top=10)
    probe_wall = time.perf_counter() - t1
    while probe.status is not Status.FINISHED:
        engine.step()
    return {
        "chunk": chunk,
        "tokens": n_seqs * prompt_len,
        "steps": steps,
        "wall_s": round(wall, 3),
        "tok_s": round(n_seqs * prompt_len / wall, 1),
        "profiled_chunk_rows": min(chunk, prompt_len),
        "profiled_step_wall_ms": round(probe_wall * 1e3, 2),
        "kernels": kernels,
    }


def engine_stage(model_dir: Path, chunks: list[int], prefill_seqs: int) -> dict:
    tokenizer = load_tokenizer(None)
    runner, build_s = server_runner(model_dir)
    print(
        f"engine: runner built with graphs for buckets {getattr(runner, 'buckets', None)} in {build_s:.1f}s", flush=True
    )
    out = {
        "build_s": build_s,
        "decode": [],
        "prefill": [],
        "weight_bytes": weight_bytes(getattr(runner, "eager_runner", runner)),
    }
    # the last row is the real job's decode: 64 sequences at the five-shot prompt's length (about 3,500 tokens)
    shapes = [(b, o, 128) for b in (1, 16, 64) for o in (False, True)] + [(64, True, 3500)]
    if SMOKE:
        shapes = [(1, False, 16), (2, True, 16)]
    for batch, overlap, prompt_len in shapes:
        r = decode_batch(
            runner,
            tokenizer,
            batch,
            prompt_len=prompt_len,
            overlap=overlap,
            new_tokens=4 if SMOKE else 64,
            profile=overlap and batch in (1, 64),
        )
        out["decode"].append(r)
        print(
            f"  decode batch {batch:3d} at context {prompt_len}, overlap {'on ' if r['overlap'] else 'off'}: "
            f"step {r['step_wall_us']:8.1f} us wall, replay {r['replay_us']:8.1f} us device, "
            f"host {r['host_us']:8.1f} us -> {r['tok_s']:9.1f} "
            f"tok/s (device only {r['tok_s_if_device_only']:9.1f})",
            flush=True,
        )
        if r["kernels"]:
            print(f"    batch-{batch} step kernels: { ({k: v for k, v in r['kernels'].items() if k != 'top'}) }")
            for name, count, us in r["kernels"].get("top", []):
                print(f"      {count:5d} x {us:10.1f} us  {name}")
        if r["host_profile"]:
            print(f"    host profile of 8 batch-{batch} steps (cProfile, tottime):")
            print("\n".join("      " + line for line in r["host_profile"].splitlines()[:40]))
    out["launch_floor_us"] = launch_floor_us()
    print(f"  launch floor: {out['launch_floor_us']} us per kernel of a graph of one-element kernels", flush=True)
    m = mixed_step(runner, tokenizer, **({"batch": 2, "chunk_rows": 16} if SMOKE else {}))
    out["mixed"] = m
    print(
        f"  mixed step: {m['batch']} decode rows + a {m['chunk_rows']}-row prompt chunk {m['mixed_step_ms']} ms "
        f"(profiled) vs pure decode {m['pure_decode_step_ms']} ms; "
        f"{ ({k: v for k, v in m['kernels'].items() if k != 'top'}) }",
        flush=True,
    )
    for chunk in chunks:
        r = prefill_rate(runner, tokenizer, chunk, prefill_seqs, **({"prompt_len": 64} if SMOKE else {}))
        out["prefill"].append(r)
        k = r["kernels"]
        print(
            f"  prefill chunk {chunk:5d}: {r['tok_s']:9.1f} tok/s ({r['tokens']} tokens, {r['steps']} steps, "
            f"{r['wall_s']:.2f}s); one {r['profiled_chunk_rows']}-row step {r['profiled_step_wall_ms']} ms wall, "
            f"{k['kernels']} kernels, device busy {(k.get('device_busy_us') or 0) / 1e3:.2f} ms",
            flush=True,
        )
        for name, count, us in k.get("top", [])[:8]:
            print(f"      {count:5d} x {us:10.1f} us  {name}")
    del runner
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- targets stage -------------------------------------------------------------------------------------------


def targets_stage(model_dir: Path, report: dict, args) -> dict:
    """The issue's other targets, in the same run: batch 1 against the weight-read limit and against transformers
    `generate` on the same checkpoint and prompt length (the 60% and 50x targets; needs the engine stage's batch-1
    rate), and the two kernel targets (`benchmarks/kernels/kernels_gpu.py --ops c2,candidate`, its table kept whole)."""
    out: dict = {}
    engine = report.get("engine") or {}
    b1 = [r for r in engine.get("decode", []) if r["batch"] == 1 and r["overlap"] == (DEVICE == "cuda")]
    if b1 and "weight_bytes" in engine:
        limit = report["copy_bandwidth_Bps"] / engine["weight_bytes"]["active_bytes"]  # forwards/s
        out["weight_read"] = {
            "limit_tok_s": round(limit, 1),
            "batch1_tok_s": b1[0]["tok_s"],
            "share": round(b1[0]["tok_s"] / limit, 4),
        }
        print(
            f"targets: batch 1 {b1[0]['tok_s']:.0f} tok/s = {b1[0]['tok_s'] / limit:.1%} of the weight-read limit "
            f"({limit:.0f} forwards/s)",
            flush=True,
        )
        prompt = torch.randint(16, 272, (128,), generator=torch.Generator().manual_seed(1)).tolist()
        hf = hf_generate_arm(str(model_dir), prompt, DEVICE, getattr(torch, DTYPE), 8 if args.smoke else 24, 2)
        med = statistics.median(hf["rounds"])
        out["transformers"] = {"rounds": hf["rounds"], "median_tok_s": med, "ratio": round(b1[0]["tok_s"] / med, 1)}
        print(
            f"targets: transformers generate {med:.1f} tok/s -> engine batch 1 is {b1[0]['tok_s'] / med:.1f}x",
            flush=True,
        )
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if DEVICE == "cuda":
        cmd = [sys.executable, "-m", "benchmarks.kernels.kernels_gpu", "--ops", "c2,candidate"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.kernels_timeout, cwd=REPO)
            text, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = f"{exc.stdout or ''}\n(timed out after {args.kernels_timeout}s)", 124
        out["kernels"] = {"rc": rc, "table": [line for line in text.splitlines() if line.startswith("|")]}
        print(f"targets: kernels_gpu.py rc {rc}", flush=True)
        print("\n".join("  " + line for line in out["kernels"]["table"]), flush=True)
    return out


# ---- http stage ----------------------------------------------------------------------------------------------


def evalpipe(*args: str, log: Path, timeout: float) -> tuple[int, float]:
    """Run `evalpipe ARGS` to completion (or `timeout`: SIGINT, as a user's Ctrl-C, and exit code 130 or 124 if it
    does not stop); returns (exit code, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "evalpipe.cli", *args], stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = 124
    return rc, time.perf_counter() - t0


def gsm8k_arm(srv, out: Path, label: str, args) -> dict:
    folder = out / "runs" / label
    rc, wall = evalpipe(
        "run",
        "gsm8k",
        "--base-url",
        srv.base + "/v1",
        "--concurrency",
        "64",
        "--max-tokens",
        GSM8K_MAX_TOKENS,
        "--num-examples",
        str(args.gsm8k_examples),
        "--arm",
        label,
        "--out",
        str(folder),
        "--data-dir",
        args.data_dir,
        "--no-progress",
        log=out / f"run-{label}.log",
        timeout=args.run_timeout,
    )
    recs = [json.loads(line) for f in folder.rglob("responses.jsonl") for line in f.read_text().splitlines()]
    usage = [r.get("usage") or {} for r in recs]
    return {
        "arm": label,
        "rc": rc,
        "wall_s": round(wall, 2),
        "records": len(recs),
        "errors": sum(1 for r in recs if r.get("error")),
        "prompt_tokens": sum(u.get("prompt_tokens", 0) for u in usage),
        "completion_tokens": sum(u.get("completion_tokens", 0) for u in usage),
        "cached_tokens": sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usage),
        "outputs": {r["question_id"]: r.get("output_token_ids") for r in recs},
    }


def bench_arm(srv, out: Path, concurrency: int, overlap: str, args, arm: str) -> dict:
    label = f"bench-c{concurrency}-overlap-{overlap}" + ("" if arm in ("cache-on", "overlap-off") else f"-{arm}")
    folder = out / "runs" / label
    rc, wall = evalpipe(
        "bench",
        "--base-url",
        srv.base + "/v1",
        "--concurrency",
        str(concurrency),
        "--input-len",
        BENCH_LENS[0],
        "--output-len",
        BENCH_LENS[1],
        "--rounds",
        str(args.bench_rounds),
        "--warmup",
        "1",
        "--client-processes",
        str(min(args.bench_client_processes, concurrency)),
        "--out",
        str(folder),
        log=out / f"{label}.log",
        timeout=300,
    )
    files = list(folder.rglob("bench.json"))
    if rc != 0 or not files:
        return {"arm": arm, "concurrency": concurrency, "overlap": overlap, "rc": rc, "wall_s": wall}
    b = json.loads(files[0].read_text())
    summ = b.get("summary", b)
    return {
        "arm": arm,
        "concurrency": concurrency,
        "overlap": overlap,
        "rc": rc,
        "wall_s": round(wall, 1),
        "client_processes": find(b.get("config"), "client_processes") or 1,
        "aggregate_tok_s": find(summ, "aggregate_tokens_per_s"),
        "per_request_decode_tok_s": find(summ, "decode_tokens_per_s"),
    }


def find(d, key):
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            got = find(v, key)
            if got is not None:
                return got
    return None


def http_stage(model_dir: Path, out: Path, args, save_partial=lambda res: None) -> dict:
    from tests.support.server_harness import ServerProcess

    extra = shlex.split(args.serve_args)
    res = {"serve_args": serve_base() + extra, "bench": [], "gsm8k": []}

    def saved() -> None:  # what is measured so far, without the per-question outputs (kept for the comparison)
        save_partial({**res, "gsm8k": [{k: v for k, v in g.items() if k != "outputs"} for g in res["gsm8k"]]})

    # (label, serve flags, bench concurrencies, gsm8k run): the defaults, the cache off, the overlap off, events of
    # 4 tokens (bench C64 only), and the defaults with --prefill-delay-factor (gsm8k only)
    arms = [
        ("cache-on", ["--prefix-cache", "on"], (1, 16, 64), True),
        ("cache-off", ["--prefix-cache", "off"], (), True),
        ("overlap-off", ["--overlap-schedule", "off"], (1, 64), False),
        ("stream-interval4", ["--stream-interval", "4"], (64,), False),
        (f"cache-on-delay{args.delay_factor:g}", ["--prefill-delay-factor", f"{args.delay_factor:g}"], (), True),
    ]
    if args.gsm8k_examples == 0:  # the bench arms only
        arms = [(label, flags, con, False) for label, flags, con, _ in arms if con]
    elif args.delay_factor == 0:
        arms = arms[:4]
    if SMOKE:  # the arm loop's every step (bench labels with and without the arm, gsm8k, the comparison), two boots
        arms = [(label, flags, (2,), gsm8k) for label, flags, _, gsm8k in arms[:2]]
    for label, flags, concurrencies, gsm8k in arms:
        overlap = "off" if "overlap-off" == label else "on"
        t0 = time.perf_counter()
        srv = ServerProcess(*serve_base(), *flags, *extra, model=str(model_dir))
        boot = time.perf_counter() - t0
        print(f"http: server {label} ({shlex.join(flags)}) ready in {boot:.1f}s", flush=True)
        try:
            for c in concurrencies:
                r = bench_arm(srv, out, c, overlap, args, label)
                res["bench"].append(r)
                saved()
                brief = {k: v for k, v in r.items() if k != "per_request_decode_tok_s"}
                print(f"  bench C{c}, overlap {overlap}: {brief}", flush=True)
            if gsm8k:
                r = gsm8k_arm(srv, out, label, args)
                r["boot_s"] = round(boot, 1)
                res["gsm8k"].append(r)
                saved()
                print(f"  gsm8k {label}: { ({k: v for k, v in r.items() if k != 'outputs'}) }", flush=True)
        finally:
            srv.stop()
            log = srv.output()
            (out / f"serve-{label}.log").write_text(log)
            for line in log.splitlines():  # the engine's own rates (serve_base: --log-level info)
                if "generated tok/s" in line:
                    print("   ", line.split("evalpipe.engine: ")[-1], flush=True)
    arms_by_label = {g["arm"]: g for g in res["gsm8k"]}
    off = arms_by_label.get("cache-off")
    for label, on in arms_by_label.items():
        if label != "cache-off" and off is not None:
            same = sum(1 for q, ids in on["outputs"].items() if off["outputs"].get(q) == ids)
            key = "" if label == "cache-on" else f"_{label}"
            res["identical_outputs" + key] = [same, len(on["outputs"])]
            res["speedup" + key] = round(off["wall_s"] / on["wall_s"], 2)
    for r in res["gsm8k"]:
        r.pop("outputs")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-real-job"))
    ap.add_argument("--data-dir", default=os.environ.get("EVALPIPE_DATA_DIR", str(REPO.parent / "shared" / "data")))
    ap.add_argument(
        "--stages",
        default="engine,targets,http",
        help="engine (in process), targets (weight-read share, transformers, kernel targets), http",
    )
    ap.add_argument("--kernels-timeout", type=float, default=150, help="seconds for kernels_gpu.py in targets")
    ap.add_argument("--gsm8k-examples", type=int, default=1314, help="0: no GSM8K runs (the bench arms only)")
    ap.add_argument("--bench-rounds", type=int, default=3)
    ap.add_argument(
        "--bench-client-processes",
        type=int,
        default=1,
        help="`evalpipe bench --client-processes` of every bench arm (at most its concurrency)",
    )
    ap.add_argument("--chunks", default="512,2048,8192", help="prefill chunk sizes of the engine stage")
    ap.add_argument("--serve-args", default="", help="more `evalpipe serve` flags for both http arms")
    ap.add_argument("--run-timeout", type=float, default=900)
    ap.add_argument(
        "--delay-factor", type=float, default=1.0, help="--prefill-delay-factor of the extra gsm8k arm (0: no such arm)"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny config, float32, 2 GSM8K questions of 8 tokens, the cache-on and cache-off servers only, "
        "one bench each (C2, 32 in / 16 out, 1 round): a dry run of the script",
    )
    args = ap.parse_args()
    global BENCH_LENS, GSM8K_MAX_TOKENS, SMOKE
    if place("gpu_real_job", args.smoke) is None:
        return 2
    if args.smoke:
        BENCH_LENS, GSM8K_MAX_TOKENS, SMOKE = ("32", "16"), "8", True
        args.gsm8k_examples, args.bench_rounds, args.delay_factor, args.chunks = 2, 1, 0.0, "512"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-real-job-"))
    report: dict = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv,
    }
    report["copy_bandwidth_Bps"] = copy_bandwidth(DEVICE, 4 << 30)
    model_dir = Path(tempfile.mkdtemp(prefix="v4-top2-")) / "model"
    t0 = time.perf_counter()
    report["parameters"] = write_checkpoint(model_dir, args.smoke)
    print(
        f"{report['device']}, torch {torch.__version__}, copy {report['copy_bandwidth_Bps'] / 1e12:.2f} TB/s; "
        f"v4-top2 checkpoint {report['parameters'] / 1e9:.3f} B parameters written in "
        f"{time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    stages = args.stages.split(",")

    def save() -> None:  # after every stage: what a stage measured survives a later one's failure or time-out
        (out / "gpu_real_job.json").write_text(json.dumps(report, indent=2, default=str))

    save()
    if "engine" in stages:
        report["engine"] = engine_stage(model_dir, [int(c) for c in args.chunks.split(",")], 2 if args.smoke else 16)
        save()
    if "targets" in stages:
        report["targets"] = targets_stage(model_dir, report, args)
        save()
    if "http" in stages:
        try:
            report["http"] = http_stage(
                model_dir, work, args, save_partial=lambda http: (report.__setitem__("http", http), save())
            )
        finally:
            with tarfile.open(out / "gpu_real_job_files.tgz", "w:gz") as tar:
                tar.add(work, arcname="gpu_real_job_files")
        save()
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print("\n| quantity | value |\n|---|---|")
    for r in report.get("engine", {}).get("decode", []):
        print(
            f"| engine decode batch {r['batch']} at context {r.get('prompt_len', 128)}, "
            f"overlap {'on' if r['overlap'] else 'off'} (in process) | "
            f"{r['tok_s']:.0f} tok/s; step {r['step_wall_us']:.0f} us = replay {r['replay_us']:.0f} + exposed host "
            f"{r['host_us']:.0f} |"
        )
    for r in report.get("engine", {}).get("prefill", []):
        print(f"| engine prefill, chunk {r['chunk']} (in process) | {r['tok_s']:.0f} tok/s |")
    targets = report.get("targets", {})
    if "weight_read" in targets:
        w = targets["weight_read"]
        print(
            f"| batch 1 vs the weight-read limit | {w['share']:.1%} ({w['batch1_tok_s']:.0f} of "
            f"{w['limit_tok_s']:.0f}) |"
        )
    if "transformers" in targets:
        t = targets["transformers"]
        print(f"| batch 1 vs transformers generate | {t['ratio']}x ({t['median_tok_s']:.1f} tok/s) |")
    for line in targets.get("kernels", {}).get("table", []):
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]  # a shape may hold "kv|gate"
        if cells and cells[0] in ("c2", "candidate"):  # kernels_gpu.py's op names
            print(
                f"| kernel {cells[0]} {cells[1]} | {cells[2]} us fused vs {cells[3]} unfused: {cells[4]}, {cells[7]} |"
            )
    http = report.get("http", {})
    for r in http.get("bench", []):
        agg = r.get("aggregate_tok_s") or {}
        per = r.get("per_request_decode_tok_s") or {}
        rounds = ", ".join(f"{v:.0f}" for v in agg.get("values") or [])
        arm = "" if r.get("arm", "cache-on") in ("cache-on", "overlap-off") else f", {r['arm']}"
        arm += f", {r['client_processes']} client processes" if (r.get("client_processes") or 1) > 1 else ""
        print(
            f"| bench C{r['concurrency']} (HTTP), overlap {r['overlap']}{arm} | aggregate {agg.get('median') or 0:.0f} "
            f"tok/s (rounds {rounds}); per request {per.get('median') or 0:.0f} |"
        )
    for r in http.get("gsm8k", []):
        print(
            f"| gsm8k x{r['records']} C64, {r['arm']} | {r['wall_s']} s, cached {r['cached_tokens']} of "
            f"{r['prompt_tokens']} prompt tokens, errors {r['errors']} |"
        )
    for key in [k for k in http if k.startswith("speedup")]:
        arm = key[len("speedup_") :] or "cache-on"
        same = http["identical_outputs" + key[len("speedup") :]]
        print(f"| gsm8k speed-up, {arm} vs cache-off | {http[key]}x; identical outputs {same} |")


if __name__ == "__main__":
    sys.exit(main())
