"""Train evalpipe's default model: a small DeepSeek-V4 (transformers' `DeepseekV4ForCausalLM`) on the synthetic
skills of `evalpipe.skills`, and write config.json, safetensors, a receipt (seeds, steps, tokens, wall time, GPU,
package versions, eval results) and a loss-curve PNG.

    python training/train_default_model.py --out runs/default --time-budget 480     # one H200, ~8 min
    python training/train_default_model.py --out /tmp/smoke --smoke                 # CPU, a few steps

Loss is on answer tokens only; an early-exit loss at each `--exit-layers` layer makes `layerskip:N` a real drafter;
the CSA indexers learn from a KL loss (dense selection for the first `--dense-fraction` of steps, then the config's
top-k); routed MoE layers are balanced by DeepSeek-V3's bias rule. The schedule is linear warm-up then cosine decay
over the planned steps; with `--time-budget` the step count is planned from the measured speed of the first steps
and written to the receipt, so `--steps N` repeats the run.

What the batches hold, and how that changes over the run, is the recipe (`--recipe`, training/curriculum.py; the
receipt records its whole schedule): v2 is the copy curriculum, v1 the mixture of the models trained before it.

One run may span several machine sessions: `--stop-after S` ends a call after S seconds with its state written,
and `--resume DIR` continues that state's schedule (same planned steps, same cosine) from its weights, with fresh
AdamW moments warmed up again over `--rewarmup` steps (the moments are not saved: they would double the checkpoint)
and a data stream of its own, so no example repeats the earlier call's. The receipt lists every call.

On CUDA the training step runs training/fast_forward.py (`--step fast` unless told otherwise) and evaluation uses
transformers' `grouped_mm` experts (one grouped GEMM, no host sync per expert), the same function as the eager
experts the oracle runs; `python -m benchmarks.model.training_step` times each step against transformers' forward,
and benchmarks/README.md keeps its figures.

This script checks its arguments (and the receipt --resume continues) before importing torch, so a refusal is
immediate; the run itself is training/trainer.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.buckets import SHORT_BUCKETS, parse_short  # noqa: E402 (no torch: arguments are checked first)
from training.curriculum import DEFAULT_RECIPE, RECIPES  # noqa: E402

CONFIG = Path(__file__).with_name("default_model_config.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (config, safetensors, receipt, PNG)")
    p.add_argument("--config", type=Path, default=CONFIG, help="DeepseekV4Config JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, hash table and data streams")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: planned from --time-budget)")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds of training when --steps is not given")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--batch-tokens", type=int, default=40960, help="padded tokens per short batch")
    p.add_argument("--long-tokens", type=int, default=24576, help="padded tokens per long (deep retrieval) batch")
    p.add_argument("--long-every", type=int, default=8, help="every N-th batch is a long one (0: never)")
    p.add_argument(
        "--short-buckets",
        default=",".join(str(b) for b in SHORT_BUCKETS),
        help="padded lengths of the short batches' length buckets, rising, the largest at least "
        f"{SHORT_BUCKETS[-1]} (fewer buckets: fewer shapes for --step compiled to compile, more padding)",
    )
    p.add_argument("--exit-layers", default="3,4", help="early-exit layers trained through the shared head")
    p.add_argument("--exit-weight", type=float, default=0.2, help="weight of each early-exit loss")
    p.add_argument("--kl-weight", type=float, default=1.0, help="weight of the indexer KL loss")
    p.add_argument("--prompt-weight", type=float, default=0.1, help="weight of the next-token loss inside prompts")
    p.add_argument(
        "--gain-lr-mult",
        type=float,
        default=3.0,
        help="learning-rate multiplier of the kv_norm gains (K=V: the only temperature attention has)",
    )
    p.add_argument("--dense-fraction", type=float, default=0.2, help="share of steps with dense CSA selection")
    p.add_argument("--bias-rate", type=float, default=1e-3, help="MoE selection-bias step per optimizer step")
    p.add_argument("--eval-every", type=float, default=100.0, help="seconds between held-out evaluations")
    p.add_argument("--eval-per-group", type=int, default=64)
    p.add_argument(
        "--recipe",
        default=None,
        choices=sorted(RECIPES),
        help=f"training recipe of training/curriculum.py: the mixture and length schedule over the run "
        f"(default: {DEFAULT_RECIPE} for a new run, the resumed run's own with --resume; v1 is the "
        f"recipe of the models trained before the curriculum)",
    )
    p.add_argument(
        "--mix",
        default="",
        help="short-mixture weights for every stage of the recipe, e.g. "
        "arith=0.3,calc=0.15 (default: the recipe's own)",
    )
    p.add_argument("--workers", type=int, default=4, help="data worker processes")
    p.add_argument("--init-from", type=Path, default=None, help="start a new run from this checkpoint's weights")
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="continue the run whose output folder (weights + receipt.json) this is, on its own schedule",
    )
    p.add_argument(
        "--stop-after",
        type=float,
        default=None,
        help="end this call after this many seconds of training, state written (resume it with --resume)",
    )
    p.add_argument("--rewarmup", type=int, default=20, help="warm-up steps of the fresh moments after --resume")
    p.add_argument(
        "--experts",
        default=None,
        choices=["eager", "grouped_mm"],
        help="transformers' experts implementation (default: grouped_mm on CUDA, eager elsewhere)",
    )
    p.add_argument(
        "--step",
        default=None,
        choices=["compiled", "dynamic", "fast", "eager"],
        help="training forward: training/fast_forward.py through torch.compile (compiled), the same with "
        "symbolic batch and sequence sizes (dynamic: torch.compile(dynamic=True)), the same "
        "uncompiled (fast), or transformers' own forward with hooks (eager); evaluation always runs "
        "transformers' forward (default: fast on CUDA, eager elsewhere; compiled compiles once per batch shape; "
        "speeds and compile times: benchmarks/README.md 'Training step')",
    )
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: 3 tiny steps, small eval")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    args = p.parse_args(argv)
    for action in p._actions:  # parse again without defaults: what remains is what this command line names
        action.default = argparse.SUPPRESS
    args.given = set(vars(p.parse_args(argv)))
    return args


# What a call may change when it resumes a run; every other argument defines the run (its data, model, loss and
# schedule), so --resume takes it from the run's first call.
PER_CALL = {
    "out",
    "resume",
    "stop_after",
    "workers",
    "device",
    "smoke",
    "eval_every",
    "eval_per_group",
    "rewarmup",
    "experts",
    "step",
    "steps",
    "time_budget",
    "init_from",
}


def restore_run_args(args, first_call: dict) -> None:
    """Set the run-defining arguments to those of the run's first call; refuse one given with another value."""
    for name, value in first_call.items():
        if name in PER_CALL or name in ("recipe", "given") or not hasattr(args, name):
            continue
        value = Path(value) if isinstance(getattr(args, name), Path) else value
        if name in args.given and getattr(args, name) != value:
            flag = "--" + name.replace("_", "-")
            raise SystemExit(f"--resume {args.resume}: that run has {flag} {value}; a resumed run keeps its settings")
        setattr(args, name, value)


def check_args(args) -> dict | None:
    """Refuse what cannot run before torch and transformers are imported (seconds); returns the receipt of the run
    --resume continues (None without --resume)."""
    if not args.config.is_file():
        raise SystemExit(f"--config {args.config}: no such file")
    try:
        [int(x) for x in args.exit_layers.split(",") if x]
    except ValueError:
        raise SystemExit(f"--exit-layers {args.exit_layers!r}: expected layer numbers, e.g. 3,4") from None
    try:
        parse_short(args.short_buckets)
    except ValueError as exc:
        raise SystemExit(f"--short-buckets {args.short_buckets!r}: {exc}") from None
    if args.mix:
        try:
            RECIPES[args.recipe or DEFAULT_RECIPE].reweighted(args.mix)
        except ValueError as exc:
            raise SystemExit(f"--mix {args.mix!r}: {exc}") from None
    if args.resume is None:
        args.recipe = args.recipe or DEFAULT_RECIPE
        return None
    receipt = args.resume / "receipt.json"
    if not receipt.is_file():
        raise SystemExit(f"--resume {args.resume}: no receipt.json there (not a run folder of this script)")
    prior = json.loads(receipt.read_text())
    if "calls" not in prior or (prior["planned_steps"] is not None and prior["steps"] >= prior["planned_steps"]):
        raise SystemExit(f"{args.resume}: nothing to resume (a finished run, or one written without --stop-after)")
    earlier = (prior.get("curriculum") or {}).get("recipe", "v1")  # runs from before the curriculum were v1
    if args.recipe not in (None, earlier):
        raise SystemExit(f"--resume {args.resume}: that run trains recipe {earlier}, not --recipe {args.recipe}")
    args.recipe = earlier
    restore_run_args(args, prior["calls"][0].get("args", {}))
    return prior


def main(argv=None):
    args = parse_args(argv)
    prior = check_args(args)
    from training.trainer import train

    train(args, prior)


if __name__ == "__main__":
    main()
