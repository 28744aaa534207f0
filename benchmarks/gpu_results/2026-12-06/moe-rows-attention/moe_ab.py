"""The decode step in process at batch 64, 32 and 1 (v4-top2, random bf16 weights) with down's "mm" kernel or its
"rows" kernel. argv: OUT SWEEP_LOG ARMS TAG [PATCH]: ARMS like mm,rows,rows,mm; the rows shape is the fastest "rows"
candidate of the sweep's E8 top2 T64 down line; PATCH: write that shape into this tree's MM_LARGE."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch

from benchmarks.serving import gpu_real_job as rj
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.kernels import moe as step_moe

KEYS = {"t": "block_t", "m": "block_m", "n": "block_n", "k": "block_k", "G": "expert_groups"}


def parse_label(label: str) -> dict:
    parts = label.split(",")
    cfg = {}
    for p in parts[1:]:
        k, v = p.split("=")
        cfg[KEYS.get(k, k)] = int(v)
    return cfg


def best_rows(sweep: str, tag: str = "E8 top2 T64") -> tuple[str, float, str, float]:
    line = next(ln for ln in sweep.splitlines() if ln.strip().startswith(f"{tag} down    us:"))
    body = line.split("us:", 1)[1].split("->")[0]
    times = {}
    for item in body.split(", "):
        label, us = item.strip().rsplit(" ", 1)
        times[label] = float(us)
    rows = {k: v for k, v in times.items() if k.startswith("rows")}
    r = min(rows, key=rows.get)
    return r, rows[r], "auto", times["auto"]


def main():
    out = Path(sys.argv[1])
    sweep = Path(sys.argv[2]).read_text()
    label, us, _, auto_us = best_rows(sweep)
    cfg = parse_label(label)
    print(f"rows shape from the sweep: {label} ({us} us/layer against auto {auto_us})", flush=True)
    step_moe.MM_LARGE["down_rows"] = (32, cfg)
    arms, tag = [a for a in sys.argv[3].split(",") if a], sys.argv[4]
    model_dir = out / "v4-top2"
    if arms and not (model_dir / "config.json").exists():
        params = rj.write_checkpoint(model_dir, False)
        print(f"{torch.cuda.get_device_name()}: checkpoint {params / 1e9:.3f} B params", flush=True)
    tok = load_tokenizer(None)
    results = []
    for arm in arms:
        step_moe.DOWN_ROWS_FROM = 32 if arm == "rows" else None  # set per arm, whatever the tree says
        runner, build_s = rj.server_runner(model_dir)
        for batch in (64, 1):
            r = rj.decode_batch(runner, tok, batch, profile=batch == 64 and not any(x["arm"] == arm for x in results))
            r["arm"] = arm
            results.append(r)
            print(
                f"  {tag} {arm:4s} batch {batch}: step {r['step_wall_us']:.1f} us wall,"
                f" replay {r['replay_us']:.1f} us ->"
                f" {r['tok_s']:.0f} tok/s (device only {r['tok_s_if_device_only']:.0f})",
                flush=True,
            )
            if r.get("kernels"):
                print("    " + json.dumps(r["kernels"])[:1500], flush=True)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
    (out / f"moe_ab_{tag}.json").write_text(json.dumps(dict(rows_shape=label, rows_cfg=cfg, results=results), indent=1))
    for batch in (64, 1):
        for arm in sorted(set(arms)):
            xs = [r for r in results if r["arm"] == arm and r["batch"] == batch]
            print(
                f"{tag} batch {batch} {arm}: tok/s "
                + " / ".join(f"{r['tok_s']:.0f}" for r in xs)
                + "; replay us "
                + " / ".join(f"{r['replay_us']:.1f}" for r in xs)
            )
    if len(sys.argv) < 6:
        return
    src = Path("evalpipe/kernels/moe.py")
    text = src.read_text()
    new = re.sub(
        r'"down_rows": \(32, dict\([^)]*\)\)',
        f'"down_rows": (32, dict({", ".join(f"{k}={v}" for k, v in cfg.items())}))',
        text,
    )
    if us < auto_us:  # the rows kernel won the sweep: the engine's auto takes it from 32 rows in this tree
        new = new.replace("DOWN_ROWS_FROM: int | None = None", "DOWN_ROWS_FROM: int | None = 32")
    src.write_text(new)
    print(
        "DOWN_ROWS_FROM in this tree now:", [ln.strip() for ln in new.splitlines() if ln.startswith("DOWN_ROWS_FROM")]
    )
    print("MM_LARGE down_rows in this tree now:", [ln.strip() for ln in new.splitlines() if '"down_rows": (' in ln])


if __name__ == "__main__":
    main()
