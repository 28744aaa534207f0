"""The default model's training run (torch, transformers): `train(args, prior)` for the arguments that
training/train_default_model.py has parsed and checked. The script's docstring describes the run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

from evalpipe.engine.model.config import load_config
from training import buckets, curriculum, data, fast_forward, objectives


def build_model(args, device):
    from transformers import DeepseekV4ForCausalLM

    config = load_config(args.config)
    torch.manual_seed(args.seed)
    experts = args.experts or ("grouped_mm" if device.type == "cuda" else "eager")
    start = args.resume or args.init_from
    if start:
        model = DeepseekV4ForCausalLM.from_pretrained(start, dtype=torch.float32, experts_implementation=experts)
    else:
        config._experts_implementation = experts
        model = DeepseekV4ForCausalLM(config)
        objectives.seed_hash_routing(model, args.seed)
    return model.to(device).train()


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model, args):
    """AdamW: weight decay on matrices only; the kv_norm gains (key = value in V4, so the gain is the only
    attention temperature a head has) learn `gain_lr_mult` times faster. Each group's `lr_mult` scales lr_at."""
    decay, gains, rest = [], [], []
    for name, p in model.named_parameters():
        (gains if "kv_norm" in name else decay if p.ndim >= 2 and "embed" not in name else rest).append(p)
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay, "lr_mult": 1.0},
            {"params": gains, "weight_decay": 0.0, "lr_mult": args.gain_lr_mult},
            {"params": rest, "weight_decay": 0.0, "lr_mult": 1.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )


def train_step(model, taps, batch, args, device, autocast, losses=None):
    """One forward and backward. `losses` (from `step_losses`): the fast forward's losses, compiled on CUDA;
    without it, transformers' own forward with the objectives' hooks."""
    ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    prompt_labels = batch["prompt_labels"].to(device, non_blocking=True)
    taps.clear()
    if losses is not None:
        loss, parts, counts = losses(model, ids, labels, prompt_labels)
        taps.router_counts.update(counts)
    else:
        with autocast():
            loss, parts = _hooked_losses(model, taps, ids, labels, prompt_labels, args)
    loss.backward()
    return {
        **{k: v.detach() for k, v in parts.items()},
        "tokens": ids.numel(),
        "answer_tokens": int((labels != -100).sum()),
    }


def _hooked_losses(model, taps, ids, labels, prompt_labels, args):
    out = model(input_ids=ids)
    exits = {n: objectives.answer_loss(objectives.exit_logits(model, taps.hidden[n]), labels) for n in taps.exit_layers}
    kl = objectives.indexer_kl(taps, model.config.compress_rates["compressed_sparse_attention"], ids.shape[1])
    return _total(out.logits, labels, prompt_labels, exits, kl, args)


def _total(logits, labels, prompt_labels, exits, kl, args):
    loss_final = objectives.answer_loss(logits, labels)
    loss_prompt = objectives.answer_loss(logits, prompt_labels)
    loss = loss_final + args.exit_weight * sum(exits.values()) + args.kl_weight * kl + args.prompt_weight * loss_prompt
    return loss, {"loss": loss_final, "kl": kl, "prompt": loss_prompt, **{f"exit{n}": v for n, v in exits.items()}}


FAST_STEPS = ("fast", "compiled", "dynamic")  # the --step kinds that run the fast forward ("eager": transformers')


def step_losses(model, args, exit_layers, device, kind: str):
    """The training losses through `training/fast_forward.py` (bf16 autocast on CUDA), as one function of
    (model, ids, labels, prompt_labels) -> (loss, parts, router counts). `kind`, one of FAST_STEPS: "fast" plain,
    "compiled" through torch.compile (one graph for forward and losses), "dynamic" compiled with symbolic batch and
    sequence sizes (torch.compile's dynamic=True) instead of a graph per batch shape."""
    if kind not in FAST_STEPS:
        raise ValueError(f"step kind must be one of {FAST_STEPS}, got {kind!r}")
    ratio = model.config.compress_rates["compressed_sparse_attention"]
    exit_layers = tuple(exit_layers)

    def losses(model, ids, labels, prompt_labels):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = fast_forward.forward(model, ids, exit_layers)
            exits = {
                n: objectives.answer_loss(objectives.exit_logits(model, s), labels) for n, s in out.exit_streams.items()
            }
            kl = objectives.compressed_kl(out.index_pairs, ratio, ids.device)
            loss, parts = _total(out.logits, labels, prompt_labels, exits, kl, args)
        return loss, parts, out.router_counts

    if kind == "dynamic":
        return torch.compile(losses, dynamic=True)
    if kind == "compiled":
        # one static graph per (batch shape, top-k): left to itself, torch recompiles at the second shape with
        # symbolic sizes (automatic_dynamic_shapes), the `dynamic` path, and stops compiling this function after
        # recompile_limit graphs (8 in torch 2.13), fewer than a run's 12 shapes at two top-ks
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        return torch.compile(losses, dynamic=False)
    return losses


def precompile(model, taps, args, device, autocast, losses, topks) -> int:
    """Run the step once per (batch shape, CSA top-k) the run can meet, before its clock starts, so a compiled
    step's compiles (a graph for each) neither stall the loop later nor bias `--time-budget`'s plan. The synthetic
    batches' gradients and router counts are dropped: the weights and the optimizer do not move. Returns how many
    steps it ran."""
    shapes = buckets.batch_shapes(
        args.batch_tokens, args.long_tokens, args.long_every, buckets.parse_short(args.short_buckets)
    )
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    for rows, width in shapes:
        ids = torch.randint(0, vocab, (rows, width), generator=gen)
        batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "prompt_labels": ids.roll(-1, 1)}
        for k in topks:
            taps.set_index_topk(k)
            train_step(model, taps, batch, args, device, autocast, losses)
            model.zero_grad(set_to_none=True)
            taps.clear()
    return len(shapes) * len(topks)


def optimizer_step(model, taps, opt, args) -> None:
    """Clip, step, clear the gradients, then move the MoE selection biases (DeepSeek-V3's balancing rule)."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    objectives.update_router_bias(taps, args.bias_rate)


@torch.no_grad()
def evaluate(model, taps, sets, device, autocast, block_size=5, batch_size=64, token_budget=32768) -> dict:
    """Teacher-forced exact match per group (all answer tokens argmax-correct = the greedy reply is exact), and per
    exit layer the greedy-speculation accept length on the model's own path (G drafts, +1 bonus per step)."""
    model.eval()
    results = {}
    for name, examples in sets.items():
        exact, accept = 0, {n: [] for n in taps.exit_layers}
        step = max(1, min(batch_size, token_budget // max(len(e) for e in examples)))
        for start in range(0, len(examples), step):
            chunk = examples[start : start + step]
            batch = data.collate(chunk)
            ids, labels = batch["input_ids"].to(device), batch["labels"].to(device)
            taps.clear()
            with autocast():
                logits = model(input_ids=ids).logits
                exit_pred = {n: objectives.exit_logits(model, taps.hidden[n]).argmax(-1) for n in taps.exit_layers}
            pred = logits.argmax(-1)
            mask = labels != -100
            exact += int(((pred == labels) | ~mask).all(-1).sum())
            for n, ep in exit_pred.items():
                for row in range(len(chunk)):
                    agree = (ep[row] == pred[row])[mask[row]].tolist()
                    accept[n].append(_accept_length(agree, block_size))
        results[name] = {
            "exact": exact / len(examples),
            "n": len(examples),
            **{f"accept{n}": sum(v) / len(v) for n, v in accept.items()},
        }
    model.train()
    return results


def _accept_length(agree: list[bool], block_size: int) -> float:
    """Tokens per verify step when drafts are accepted while the exit agrees with the final layer."""
    pos, steps = 0, 0
    while pos < len(agree):
        n = 0
        while n < block_size and pos + n < len(agree) - 1 and agree[pos + n]:
            n += 1
        pos += n + 1
        steps += 1
    return len(agree) / steps


def package_versions() -> dict:
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def git_commit() -> str | None:
    """HEAD of the checkout, or $EVALPIPE_GIT_COMMIT where the code was copied without its .git (a GPU box)."""
    if os.environ.get("EVALPIPE_GIT_COMMIT"):
        return os.environ["EVALPIPE_GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def save(model, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="15MB")
    (out / "generation_config.json").unlink(missing_ok=True)


def plot(history: list[dict], evals: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    steps = [h["step"] for h in history]
    for key in [k for k in history[0] if k.startswith(("loss", "exit", "kl"))]:
        a.plot(steps, [h[key] for h in history], label=key, linewidth=0.8)
    a.set_yscale("log")
    a.set_xlabel("step")
    a.set_title("training losses (answer tokens)")
    a.legend()
    for name in evals[-1]["results"] if evals else []:
        b.plot([e["step"] for e in evals], [e["results"][name]["exact"] for e in evals], label=name, marker=".")
    b.set_xlabel("step")
    b.set_ylim(-0.02, 1.02)
    b.set_title("held-out exact match (teacher forced)")
    b.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(model, taps, args, topk, facts, history, evals) -> None:
    """Weights (with the config's own top-k), receipt and loss curve; called at every eval so a killed run still
    leaves its latest state."""
    dense_k = (
        taps.model.model.layers[taps.csa_layers[0]].self_attn.compressor.indexer.index_topk if taps.csa_layers else topk
    )
    taps.set_index_topk(topk)
    save(model, args.out)
    taps.set_index_topk(dense_k)
    receipt = {
        "what": "evalpipe default model: DeepseekV4ForCausalLM trained on evalpipe.skills",
        **facts,
        "parameters": sum(p.numel() for p in model.parameters()),
        "packages": package_versions(),
        "optimizer_note": "AdamW moments start fresh at each --resume call (re-warmed over --rewarmup steps)",
        "final_eval": evals[-1] if evals else None,
        "evals": evals,
        "history": history,
    }
    (args.out / "receipt.json").write_text(json.dumps(receipt, indent=1))
    if history:
        plot(history, evals, args.out / "loss.png")


def train(args, prior: dict | None) -> None:
    """The run `args` describe (train_default_model.py has checked them), continuing `prior` (the receipt of the
    run folder given to --resume) when there is one."""
    if args.smoke:  # every code path once, on CPU-sized batches
        args.steps, args.batch_tokens, args.long_tokens, args.long_every = 3, 1024, 1536, 3
        args.eval_per_group, args.workers, args.warmup, args.eval_every = 2, 0, 1, 1e9
        data.LONG_AFTER = (128, 256)  # a long batch in the smallest long bucket (1536), not the next (2560)
    recipe = curriculum.RECIPES[args.recipe]
    if args.mix:
        recipe = recipe.reweighted(args.mix)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    random.seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if device.type == "cuda"
        else (lambda: torch.autocast("cpu", enabled=False))
    )
    model = build_model(args, device)
    exit_layers = [int(x) for x in args.exit_layers.split(",") if x]
    taps = objectives.Taps(model, exit_layers)
    opt = optimizer(model, args)
    step_kind = args.step or ("fast" if device.type == "cuda" else "eager")
    losses = None if step_kind == "eager" else step_losses(model, args, exit_layers, device, step_kind)
    call = len(prior["calls"]) if prior else 0
    stream = data.BatchStream(
        args.seed,
        args.batch_tokens,
        args.long_tokens,
        args.long_every,
        call=call,
        recipe=recipe,
        progress=prior["steps"] / prior["planned_steps"] if prior else 0.0,
        short_buckets=buckets.parse_short(args.short_buckets),
    )
    loader = torch.utils.data.DataLoader(
        stream,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=device.type == "cuda",
        prefetch_factor=4 if args.workers else None,
        persistent_workers=bool(args.workers),
    )
    sets = data.eval_sets(per_group=args.eval_per_group, max_after=256 if args.smoke else 4096)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters on {device}; exits {exit_layers}; {step_kind} step", flush=True)

    total = prior["planned_steps"] if prior else args.steps
    step = first_step = prior["steps"] if prior else 0
    history, evals = (prior["history"], prior["evals"]) if prior else ([], [])
    tokens, answer_tokens = (prior["tokens"], prior["answer_tokens"]) if prior else (0, 0)
    start_tokens = tokens
    earlier_wall = prior["wall_s"] if prior else 0.0
    calls = prior["calls"] if prior else []
    calibrate_at = 30
    topk = model.config.index_topk
    t0 = time.time()
    last_eval = t0
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    this_call = {
        "call": call,
        "first_step": first_step,
        "command": " ".join(sys.argv),
        "git_commit": git_commit(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "given"},
    }

    def receipt_facts():
        call_wall = round(time.time() - t0, 1)
        return {
            "seed": args.seed,
            "data_streams": f"train|{args.seed}|<worker> of {max(1, args.workers)}[|call<k>]",
            "eval_seed": "train-eval|1234 (held-out split)",
            "steps": step,
            "planned_steps": total,
            "tokens": tokens,
            "answer_tokens": answer_tokens,
            "wall_s": round(earlier_wall + call_wall, 1),
            "device": device_name,
            "curriculum": recipe.describe(),
            "calls": calls + [{**this_call, "last_step": step, "wall_s": call_wall}],
        }

    if step_kind == "compiled":
        planned_before = prior["planned_steps"] if prior else None
        dense_left = not planned_before or prior["steps"] < args.dense_fraction * planned_before
        started = time.time()
        ran = precompile(model, taps, args, device, autocast, losses, ([10**9] if dense_left else []) + [topk])
        this_call["precompile_s"] = round(time.time() - started, 1)
        print(f"compiled the step for {ran} batch shapes and top-ks in {this_call['precompile_s']} s", flush=True)
        t0 = last_eval = time.time()
    t_cal = time.time()  # reset at the tenth step of this call, when compilation is behind it
    for batch in loader:
        local = step - first_step
        if total is None and local == calibrate_at:  # plan the run from the measured speed
            per_step = (time.time() - t_cal) / (calibrate_at - 10)
            total = max(calibrate_at + 1, int(args.time_budget / per_step))
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            print(f"planned {total} steps ({per_step * 1e3:.0f} ms/step, peak memory {mem:.1f} GiB)", flush=True)
        if local == 10:
            t_cal = time.time()
        planned = total or 10**9
        stream.set_progress(step / total if total else 0.0)
        dense = total is None or step < args.dense_fraction * total
        taps.set_index_topk(10**9 if dense else topk)
        rewarm = min(1.0, (local + 1) / args.rewarmup) if prior else 1.0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10**9, args) * g["lr_mult"] * rewarm
        stats = train_step(model, taps, batch, args, device, autocast, losses)
        optimizer_step(model, taps, opt, args)
        tokens += stats.pop("tokens")
        answer_tokens += stats.pop("answer_tokens")
        if step % 10 == 0 or step == planned - 1:
            row = {
                "step": step,
                "time_s": earlier_wall + time.time() - t0,
                "lr": opt.param_groups[0]["lr"],
                "dense": dense,
                **{k: float(v) for k, v in stats.items()},
            }
            history.append(row)
            print(json.dumps(row), flush=True)
        step += 1
        now = time.time()
        stopping = step >= planned or (args.stop_after is not None and now - t0 > args.stop_after)
        if now - last_eval > args.eval_every or stopping:
            res = evaluate(model, taps, sets, device, autocast)
            evals.append({"step": step, "time_s": earlier_wall + now - t0, "results": res})
            print(
                "eval",
                step,
                json.dumps({k: round(v["exact"], 3) for k, v in res.items()}),
                json.dumps({k: round(v.get(f"accept{exit_layers[-1]}", 0), 2) for k, v in res.items()}),
                flush=True,
            )
            if not stopping:
                write_outputs(model, taps, args, topk, receipt_facts(), history, evals)
            last_eval = time.time()
        if stopping:
            break
    write_outputs(model, taps, args, topk, receipt_facts(), history, evals)
    left = f"; {total - step} planned steps left (--resume {args.out})" if total and step < total else ""
    print(
        f"wrote {args.out} in {time.time() - t0:.0f} s ({(tokens - start_tokens) / (time.time() - t0):.0f}"
        f" tokens/s){left}",
        flush=True,
    )
