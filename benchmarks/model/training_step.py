"""Step time of the default model's training (`training/trainer.py`, run by `training/train_default_model.py`) under
each option, side by side in one process, at each batch size: transformers' forward with its eager or `grouped_mm`
experts (optionally through `model.compile()`), or the trainer's fast forward (`training/fast_forward.py`) plain
(`fast`) or compiled whole with its losses (`compiled`, the trainer's default on CUDA). Same model, same batches,
same losses (the options change kernels, not the function).

    python -m benchmarks.model.training_step [--batch-tokens 40960,131072] [--steps 6] [--width 512] [--stream 40]

Prints one row per (option, batch): ms per optimizer step, padded tokens/s, peak memory, the first step's loss.
`--stream N` adds one row per option over N consecutive batches of the training script's own stream (its length
buckets, `--short-buckets` as the script takes it, and every 8th batch long, as the loop sees them, data loading
excluded) with the loop's full optimizer step: the untimed first step of each batch shape apart (a compiled
option's compiles), the share of real tokens, and the share of that wall time the GPU spends in kernels
(torch.profiler over the last batches): well under 100% means the step is bound by the host launching kernels,
not by the GPU.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from training import buckets, data, objectives, trainer
from training.train_default_model import parse_args

# an option is an experts implementation of transformers' forward ("+compile": through model.compile()), or the
# trainer's fast forward: "fast" (plain), "compiled" (forward and losses through torch.compile) or "dynamic" (the same
# with symbolic sizes: with --stream, whether it compiles fewer times over the stream's batch shapes)
OPTIONS = ["grouped_mm", "grouped_mm+compile", "fast", "compiled"]
MODEL_ARGS: list[str] = []  # more training-script flags for every option's model (--smoke: the tiny config)


def parse_option(option: str) -> tuple[str, bool]:
    if option in trainer.FAST_STEPS:
        return option, option != "fast"
    experts, _, extra = option.partition("+")
    if experts not in ("eager", "grouped_mm") or extra not in ("", "compile"):
        raise SystemExit(
            f"unknown option {option!r}: fast, compiled, or an experts implementation (eager, "
            "grouped_mm), optionally +compile"
        )
    return experts, extra == "compile"


def batch_of(tokens: int, width: int, seed: int) -> dict:
    rng = random.Random(seed)
    examples = []
    while len(examples) * width < tokens:
        ex = data.sample_short(rng)
        if len(ex) <= width:
            examples.append(ex)
    return data.collate(examples, width=width)


def make_step(experts: str, device, compiled: bool = False):
    """A fresh model and optimizer as the training script builds them, its step (the loop's train_step and
    optimizer_step) and a device sync. `experts` "fast"/"compiled": the trainer's fast forward; otherwise
    transformers' forward with that experts implementation, `compiled`: through `model.compile()`."""
    fast = experts in trainer.FAST_STEPS
    args = parse_args(["--out", "/dev/null", "--experts", "eager" if fast else experts, *MODEL_ARGS])
    model = trainer.build_model(args, device)
    if compiled and not fast:
        model.compile()
    taps = objectives.Taps(model, [3, 4])
    opt = trainer.optimizer(model, args)
    losses = trainer.step_losses(model, args, [3, 4], device, experts) if fast else None
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else (lambda: torch.autocast("cpu", enabled=False))
    )

    def step(batch):
        stats = trainer.train_step(model, taps, batch, args, device, autocast, losses)
        trainer.optimizer_step(model, taps, opt, args)
        return stats

    return step, (torch.cuda.synchronize if device.type == "cuda" else (lambda: None))


def time_option(experts: str, batch: dict, steps: int, device, compiled: bool = False) -> dict:
    step, sync = make_step(experts, device, compiled)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    first_loss = None
    started = time.perf_counter()
    for i in range(steps + 2):  # two untimed steps: compilation and allocator warm-up
        if i == 2:
            sync()
            t = time.perf_counter()
            warm_s = t - started
        stats = step(batch)
        first_loss = first_loss if first_loss is not None else float(stats["loss"])
    sync()
    per_step = (time.perf_counter() - t) / steps
    mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    tok_s = batch["input_ids"].numel() / per_step
    return {"ms": per_step * 1e3, "tok_s": tok_s, "mem": mem, "loss": first_loss, "warm_s": warm_s}


def profile_option(option: str, batch: dict, device, top: int = 45) -> str:
    """torch.profiler over two steps after two warm-up steps: the ops with the most device time, as a table."""
    from torch.profiler import ProfilerActivity, profile

    experts, compiled = parse_option(option)
    step, sync = make_step(experts, device, compiled)
    for _ in range(2):
        step(batch)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            step(batch)
        sync()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60)


def time_stream(option: str, batches: list[dict], device, profiled: int = 6) -> dict:
    """The loop's step over the stream's batches: one untimed step per batch shape first (a compiled option's
    compiles, timed apart), then mean ms per step, the share of real (unpadded) tokens, and kernel time / wall over
    the last ones."""
    experts, compiled = parse_option(option)
    step, sync = make_step(experts, device, compiled)
    first_of_shape = {tuple(b["input_ids"].shape): b for b in reversed(batches)}
    started = time.perf_counter()
    for batch in first_of_shape.values():
        step(batch)
    sync()
    warm_s = time.perf_counter() - started
    timed = batches
    by_shape: dict[tuple, list[float]] = {}
    sync()
    t = time.perf_counter()
    for batch in timed:
        t_step = time.perf_counter()
        step(batch)
        sync()  # per-step times by shape; the sync costs the overlap of one step's tail with the next's launches
        by_shape.setdefault(tuple(batch["input_ids"].shape), []).append(time.perf_counter() - t_step)
    per_step = (time.perf_counter() - t) / len(timed)
    tokens = sum(b["input_ids"].numel() for b in timed) / len(timed)
    busy = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        tail = timed[-profiled:]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for batch in tail:
                step(batch)
            sync()
            wall = time.perf_counter() - t
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        busy = kernel_us / 1e6 / wall
    real = sum(int((b["input_ids"] != data.PAD_ID).sum()) for b in timed) / len(timed)
    return {
        "ms": per_step * 1e3,
        "tok_s": tokens / per_step,
        "tokens": tokens,
        "real_share": real / tokens,
        "busy": busy,
        "by_shape": by_shape,
        "warm_s": warm_s,
        "shapes": len(first_of_shape),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-tokens", default="40960,131072", help="comma-separated padded tokens per step")
    ap.add_argument("--width", type=int, default=512, help="padded sequence length of every row")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per row (after two untimed ones)")
    ap.add_argument(
        "--stream",
        type=int,
        default=0,
        help="also time this many batches of the training stream with the loop's full step (0: off)",
    )
    ap.add_argument(
        "--stream-tokens",
        type=int,
        default=40960,
        help="with --stream: padded tokens per short batch (long batches: 24,576)",
    )
    ap.add_argument(
        "--short-buckets",
        default=",".join(str(b) for b in buckets.SHORT_BUCKETS),
        help="with --stream: the short batches' length buckets, as the training script's flag",
    )
    ap.add_argument(
        "--options", default=",".join(OPTIONS), help=f"comma-separated options to time (default: {','.join(OPTIONS)})"
    )
    ap.add_argument(
        "--profile",
        default=None,
        metavar="OPTION",
        help="also print the ops with the most device time over two steps of OPTION at the first batch size",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="seconds on the CPU: the engine's tiny config, two 128-token rows, one timed step, eager experts, and "
        "a one-batch stream of 656 tokens in two buckets (checks the script runs)",
    )
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.batch_tokens, args.width, args.steps, args.options, args.device = "256", 128, 1, "eager,fast", "cpu"
        # the stream's first example (seed 0) has 654 tokens: a 656 bucket holds it in a 1 x 656 batch, not 1 x 1024
        args.stream, args.stream_tokens, args.short_buckets = 1, 656, "656,1024"
        from evalpipe.engine.model.config import TINY_CONFIG_PATH

        MODEL_ARGS[:] = ["--config", str(TINY_CONFIG_PATH)]  # 4 layers of every kind the default model has
    options = args.options.split(",")
    for option in options:
        parse_option(option)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}, width {args.width}, {args.steps} timed steps per row")
    print(
        f"{'option':<19} {'batch tokens':>12} {'ms/step':>9} {'tokens/s':>10} {'peak GiB':>9} {'loss@0':>8} "
        f"{'warm-up s':>9}"
    )
    sizes = [int(x) for x in args.batch_tokens.split(",")]
    for tokens in sizes:
        batch = batch_of(tokens, args.width, seed=tokens)
        for option in options:
            experts, compiled = parse_option(option)
            r = time_option(experts, batch, args.steps, device, compiled)
            print(
                f"{option:<19} {batch['input_ids'].numel():>12} {r['ms']:>9.1f} "
                f"{r['tok_s']:>10.0f} {r['mem']:>9.1f} {r['loss']:>8.4f} {r['warm_s']:>9.1f}",
                flush=True,
            )
    if args.profile:
        print(f"\nprofile of {args.profile} at {sizes[0]} tokens, two steps")
        print(profile_option(args.profile, batch_of(sizes[0], args.width, seed=sizes[0]), device), flush=True)
    if args.stream:
        try:
            short = buckets.parse_short(args.short_buckets)
        except ValueError as exc:
            raise SystemExit(f"--short-buckets {args.short_buckets!r}: {exc}") from None
        stream = data.BatchStream(
            seed=0, batch_tokens=args.stream_tokens, long_tokens=24576, long_every=8, short_buckets=short
        )
        it = iter(stream)
        batches = [next(it) for _ in range(args.stream)]
        print(
            f"\ntraining stream, {args.stream} timed batches (short buckets {args.short_buckets}, every 8th long), "
            "full optimizer step, after one untimed step per batch shape"
        )
        print(
            f"{'option':<19} {'shapes':>6} {'warm-up s':>9} {'mean tokens':>12} {'ms/step':>9} {'tokens/s':>10} "
            f"{'real share':>10} {'real tok/s':>10} {'GPU busy':>9}"
        )
        for option in options:
            r = time_stream(option, batches, device)
            busy = f"{r['busy']:.0%}" if r["busy"] is not None else "n/a"
            print(
                f"{option:<19} {r['shapes']:>6} {r['warm_s']:>9.1f} {r['tokens']:>12.0f} {r['ms']:>9.1f} "
                f"{r['tok_s']:>10.0f} {r['real_share']:>10.2f} {r['tok_s'] * r['real_share']:>10.0f} {busy:>9}",
                flush=True,
            )
            for (rows, width), times in sorted(r["by_shape"].items(), key=lambda kv: kv[0][1]):
                print(f"  {rows:>4} x {width:<5} {len(times):>3} steps {1e3 * sum(times) / len(times):>8.1f} ms/step")


if __name__ == "__main__":
    main()
