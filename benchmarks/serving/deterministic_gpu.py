"""On one GPU: with `deterministic` (EngineConfig; `evalpipe serve --deterministic`), does a greedy output
depend on its prompt alone -- prefix cache on vs off, speculation off vs block (ngram, layerskip), concurrency 64 vs
1 -- and what does it cost in C64 decode? The same arms in the default mode give today's column beside it.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python -m benchmarks.serving.deterministic_gpu --data-dir DIR \
        [--prompts 128] [--c1-prompts 128] [--max-tokens 128] [--modes deterministic,default] [--drafters ngram]

Each mode builds four engines (CUDA graphs captured for every bucket) and runs its arms; run the two modes as two
commands (`--modes deterministic`, then `--modes default`) when one command has a time limit.

In process (no HTTP), on `benchmarks/serving/gpu_serving.py`'s v4-top2 (2.11 B parameters, random bf16 weights,
written once), each arm an engine built as the server builds it (`evalpipe.engine.loop.build_engine`: CUDA graphs
for every batch bucket up to 64). Prompts: the gsm8k lane's five-shot prompts (questions 5.. of
gsm8k/test.jsonl), greedy, `--max-tokens` tokens each, EOS ignored (fixed-length outputs compared token for token).
- cache: `--prompts` prompts at concurrency 64, prefix cache on vs off;
- spec: the cache-on arm vs block speculation (G 5) with the ngram drafter and with the layerskip drafter;
- concurrency: the first `--c1-prompts` prompts one at a time vs the cache-off C64 arm's outputs;
- decode: tok/s of the steady C64 decode step (gpu_real_job's `decode_batch`: 64 x 128-token prompts), default
  vs deterministic, and their ratio (target >= 0.70);
- kernels: one bf16 row of [64, 4096] @ [4096, 4096] alone vs among 63 other rows, bitwise, through F.linear
  (cuBLAS) and through kernels/batch_invariant.matmul.
A table at the end; every number also in `OUT/deterministic_gpu.json`. `--smoke`: CPU, the tiny config, float32,
short random prompts, a few tokens, the decode rate of 2 sequences of 16-token prompts (a dry run of the logic; the
CPU path runs the PyTorch references).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.serving import gpu_real_job
from evalpipe.engine.build import build
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.loop import build_engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.kernels import batch_invariant

REPO = Path(__file__).resolve().parents[2]


def gsm8k_prompts(data_dir: str, count: int, tokenizer) -> list[list[int]]:
    from evalpipe.lanes.gsm8k import LANE

    items = LANE.load(Path(data_dir), allow_data_drift=True).items[:count]
    return [tokenizer.encode_prompt(item.prompt) for item in items]


def random_prompts(count: int, length: int, tokenizer) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        tokenizer.encode_prompt(bytes(torch.randint(97, 123, (length,), generator=gen).tolist()).decode())
        for _ in range(count)
    ]


def engine_for(model_dir: Path, device: str, dtype: str, **fields):
    config = EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_batch=64, **fields)
    return build_engine(config, build, lambda c: load_tokenizer(None))


def generate(engine, prompts: list[list[int]], max_tokens: int, concurrency: int) -> list[list[int]]:
    """Greedy outputs of `prompts`, at most `concurrency` in flight (a new one enters as one finishes)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(prompt=list(p), params=params) for p in prompts]
    waiting, live = list(seqs), []
    while waiting or live:
        live = [s for s in live if s.status is not Status.FINISHED]
        while waiting and len(live) < concurrency:
            live.append(waiting.pop(0))
            engine.submit([live[-1]])
        if live:
            engine.step()
        live = [s for s in live if s.status is not Status.FINISHED]
    return [list(s.output) for s in seqs]


def compare(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical outputs / total, and the median first differing token of the others."""
    firsts = [next(i for i, (x, y) in enumerate(zip(p, q)) if x != y) for p, q in zip(a, b) if p != q]
    return {
        "identical": sum(p == q for p, q in zip(a, b)),
        "total": len(a),
        "median_first_diff": statistics.median(firsts) if firsts else None,
    }


def release(*objects) -> None:
    del objects
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def mode_arms(model_dir: Path, args, device: str, dtype: str, deterministic: bool, prompts, log) -> dict:
    """Every arm of one mode: the identical-output comparisons and the C64 decode rate."""
    out: dict = {}
    outputs: dict = {}
    arms = [
        ("cache_on", dict(prefix_cache="on")),
        ("cache_off", dict(prefix_cache="off")),
        ("spec_ngram", dict(speculative="block", drafter="ngram")),
        ("spec_layerskip", dict(speculative="block")),
    ]
    arms = [(name, fields) for name, fields in arms if not name.startswith("spec_") or name[5:] in args.drafters]
    for name, fields in arms:
        t0 = time.perf_counter()
        engine = engine_for(model_dir, device, dtype, deterministic=deterministic, **fields)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        outputs[name] = generate(engine, prompts, args.max_tokens, 64)
        log(f"  {name}: built in {built:.1f}s, {len(prompts)} prompts at C64 in {time.perf_counter() - t0:.1f}s")
        if name == "cache_off":
            t0 = time.perf_counter()
            outputs["c1"] = generate(engine, prompts[: args.c1_prompts], args.max_tokens, 1)
            log(f"  {name}: {args.c1_prompts} prompts at C1 in {time.perf_counter() - t0:.1f}s")
        if name == "cache_on":
            t0 = time.perf_counter()
            batch, prompt_len = args.decode_shape
            decode = gpu_real_job.decode_batch(
                engine.runner, engine.tokenizer, batch, prompt_len=prompt_len, new_tokens=args.decode_tokens
            )
            out["decode_c64_tok_s"] = decode["tok_s"]
            log(f"  C64 decode {decode['tok_s']:.0f} tok/s ({time.perf_counter() - t0:.1f}s)")
        release(engine)
    out["cache_on_vs_off"] = compare(outputs["cache_on"], outputs["cache_off"])
    for drafter in args.drafters:
        out[f"spec_off_vs_{drafter}"] = compare(outputs["cache_on"], outputs[f"spec_{drafter}"])
    out["c64_vs_c1"] = compare(outputs["cache_off"][: args.c1_prompts], outputs["c1"])
    return out


def kernel_rows(device: str, dtype: torch.dtype) -> dict:
    """One row alone vs at row 37 of 64 random rows: bitwise equal through F.linear (cuBLAS on CUDA) and through the
    invariant GEMM (its Triton kernel on CUDA; on the CPU its reference, a torch matmul: no claim there)."""
    gen = torch.Generator(device=device).manual_seed(1)
    size = 4096 if device == "cuda" else 256
    w = torch.randn(size, size, generator=gen, device=device).to(dtype)
    rows = torch.randn(64, size, generator=gen, device=device).to(dtype)
    res = {}
    for name, fn in (
        ("f_linear", lambda x: F.linear(x, w)),
        ("batch_invariant", lambda x: batch_invariant.matmul(x, w.t())),
    ):
        res[name] = bool(torch.equal(fn(rows[37:38])[0], fn(rows)[37]))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "deterministic-gpu"), help="folder for the JSON report")
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("EVALPIPE_DATA_DIR", str(REPO.parent / "shared" / "data")),
        help="folder holding gsm8k/test.jsonl",
    )
    ap.add_argument("--prompts", type=int, default=128, help="GSM8K prompts of the cache and spec arms (C64)")
    ap.add_argument("--c1-prompts", type=int, default=128, help="prompts of the concurrency 1 vs 64 arm")
    ap.add_argument("--max-tokens", type=int, default=128, help="greedy tokens per prompt (EOS ignored)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens per sequence of the C64 decode rate")
    ap.add_argument(
        "--drafters", default="ngram,layerskip", help="drafters of the speculation arms (ngram and/or layerskip)"
    )
    ap.add_argument("--modes", default="deterministic,default", help="which modes run: deterministic, default or both")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny config, float32, 3 random 40-byte prompts, 4 tokens each, the decode rate of 2 x 16 tokens",
    )
    args = ap.parse_args()
    args.decode_shape = (64, 128)  # the C64 decode rate's sequences and prompt tokens (gpu_real_job's decode_batch)
    modes = [m for m in args.modes.split(",") if m]
    args.drafters = [d for d in args.drafters.split(",") if d]
    if set(args.drafters) - {"ngram", "layerskip"}:
        print(f"deterministic_gpu: --drafters takes ngram and/or layerskip, got {args.drafters!r}", file=sys.stderr)
        return 2
    if not modes or set(modes) - {"deterministic", "default"}:
        print(f"deterministic_gpu: --modes takes deterministic and/or default, got {args.modes!r}", file=sys.stderr)
        return 2
    placed = gpu_real_job.place("deterministic_gpu", args.smoke)
    if placed is None:
        return 2
    device, dtype = placed
    if args.smoke:
        args.prompts, args.c1_prompts, args.max_tokens, args.decode_tokens = 3, 2, 4, 4
        args.decode_shape = (2, 16)  # 64 x 128-token prefills would be most of the dry run's time
    args.c1_prompts = min(args.c1_prompts, args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "argv": sys.argv}
    report["kernel_rows_bitwise"] = kernel_rows(device, getattr(torch, dtype))
    log(f"kernel rows alone vs in a batch of 64, bitwise: {report['kernel_rows_bitwise']}")
    model_dir = Path(tempfile.mkdtemp(prefix="v4-top2-")) / "model"
    report["parameters"] = gpu_real_job.write_checkpoint(model_dir, args.smoke)
    log(f"checkpoint {report['parameters'] / 1e9:.3f} B parameters")
    tokenizer = load_tokenizer(None)
    if args.smoke:
        prompts = random_prompts(args.prompts, 40, tokenizer)
    else:
        prompts = gsm8k_prompts(args.data_dir, args.prompts, tokenizer)
    log(f"{len(prompts)} prompts, {statistics.mean(len(p) for p in prompts):.0f} tokens on average")
    for mode in modes:
        log(f"mode {mode}")
        report[mode] = mode_arms(model_dir, args, device, dtype, mode == "deterministic", prompts, log)
        (out / "deterministic_gpu.json").write_text(json.dumps(report, indent=2))
    print_table(report, modes)
    return 0


def print_table(report: dict, modes: list[str]) -> None:
    def cell(res: dict | None) -> str:
        if res is None:
            return "-"
        first = f" (first diff at {res['median_first_diff']:g})" if res["median_first_diff"] is not None else ""
        return f"{res['identical']}/{res['total']}{first}"

    rows = [
        ("cache on vs off (C64)", "cache_on_vs_off"),
        ("spec off vs block ngram", "spec_off_vs_ngram"),
        ("spec off vs block layerskip", "spec_off_vs_layerskip"),
        ("concurrency 64 vs 1", "c64_vs_c1"),
    ]
    print("\n| identical outputs | deterministic | default |")
    print("|---|---|---|")
    for label, key in rows:
        det, default = report.get("deterministic", {}).get(key), report.get("default", {}).get(key)
        print(f"| {label} | {cell(det)} | {cell(default)} |")
    rates = {m: report[m]["decode_c64_tok_s"] for m in modes}
    ratio = rates["deterministic"] / rates["default"] if len(rates) == 2 else None
    print(
        f"| C64 decode tok/s | {rates.get('deterministic', '-')} | {rates.get('default', '-')} |"
        + (f"\n| deterministic / default | {ratio:.2f} (target >= 0.70) | |" if ratio is not None else "")
    )
    bits = report["kernel_rows_bitwise"]
    ours, torchs = bits["batch_invariant"], bits["f_linear"]
    print(f"| GEMM row alone = in batch of 64 | invariant GEMM: {ours} | F.linear: {torchs} |")


if __name__ == "__main__":
    sys.exit(main())
