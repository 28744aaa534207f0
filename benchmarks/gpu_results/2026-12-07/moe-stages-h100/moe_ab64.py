"""The C64 decode step with other MoE launch shapes (MM_LARGE's gate_up and down_rows), in process on the runner the
server builds: for each variant, the table entry set, a fresh runner built (its CUDA graphs captured with it), the
variant's kernels checked against the references on one layer's MoE, then the C64 step timed (decode_batch: wall with
the overlap schedule on, and the graph replay's device time). Variants in the order given, base first and last;
then the best two again beside base.

    python .gpu/moe_ab64.py OUT [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from benchmarks.serving import gpu_real_job as rj
from evalpipe.engine.tokenizer import load_tokenizer
from evalpipe.kernels import moe as step_moe

GU = dict(step_moe.MM_LARGE["gate_up"][1])
DN = dict(step_moe.MM_LARGE["down_rows"][1])
VARIANTS = {
    "base": {},
    "gu stages 4": {"gate_up": dict(GU, num_stages=4)},
    "gu k128": {"gate_up": dict(GU, block_k=128)},
    "gu n128": {"gate_up": dict(GU, block_n=128)},
    "dn stages 4": {"down_rows": dict(DN, num_stages=4)},
    "dn n64 k128": {"down_rows": dict(DN, block_n=64, block_k=128)},
    "dn n64 k64 reg128 s4": {"down_rows": dict(DN, block_n=64, block_k=64, maxnreg=128, num_stages=4)},
    "dn k256": {"down_rows": dict(DN, block_k=256, num_stages=2)},
}
if (
    os.environ.get("MOE_SET") == "k128"
):  # on the tree where gate_up's block_k is 128 (commit 43d6fc4): the old 64 beside it
    VARIANTS = {
        "base": {},
        "gu k64": {"gate_up": dict(GU, block_k=64)},
        "gu k128 s4": {"gate_up": dict(GU, num_stages=4)},
        "gu k256 s2": {"gate_up": dict(GU, block_k=256, num_stages=2)},
    }


def set_variant(name: str) -> None:
    for kernel, shape in (("gate_up", GU), ("down_rows", DN)):
        start = step_moe.MM_LARGE[kernel][0]
        step_moe.MM_LARGE[kernel] = (start, dict(VARIANTS[name].get(kernel, shape)))


def check(runner) -> float:
    """Largest relative error of gate_up and down (this variant's shapes, T 64) against the references on one MoE
    layer of the runner's model."""
    moe = next(layer.mlp for layer in runner.model.layers if not layer.mlp.is_hash)
    dev = runner.model.device
    g = torch.Generator(device=dev).manual_seed(7)
    T, K = 64, moe.top_k
    x = (torch.randn(T, moe.router.shape[1], generator=g, device=dev)).to(runner.model.dtype)
    E = moe.router.shape[0]
    idx = torch.cat([torch.randint(0, E, (T, K), generator=g, device=dev), torch.full((T, 1), E, device=dev)], 1)
    w = torch.rand(T, K + 1, generator=g, device=dev)
    h = step_moe.gate_up(moe, x, idx, backend="triton")
    h_ref = step_moe.gate_up_reference(moe, x, idx)
    y = step_moe.down(moe, h_ref, idx, w, backend="triton")
    y_ref = step_moe.down_reference(moe, h_ref, idx, w)

    def rel(a, b):
        return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))

    return max(rel(h, h_ref), rel(y, y_ref))


def measure(model_dir: Path, tokenizer, name: str) -> dict:
    set_variant(name)
    t0 = time.perf_counter()
    runner, _ = rj.server_runner(model_dir)
    built = time.perf_counter() - t0
    err = check(runner)
    r = rj.decode_batch(runner, tokenizer, 64, overlap=True)
    row = {"variant": name, "step_wall_us": r["step_wall_us"], "replay_us": r["replay_us"], "rel_err": err}
    print(
        f"  {name:24s} step {r['step_wall_us']:7.1f} us, replay {r['replay_us']:7.1f} us, "
        f"kernel rel err {err:.2e}, built in {built:.1f}s",
        flush=True,
    )
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    rj.place("moe_ab64", a.smoke)
    model_dir = a.out / "v4-top2"
    if not (model_dir / "config.json").exists():  # the same seeded weights as another script's
        rj.write_checkpoint(model_dir, a.smoke)
    tokenizer = load_tokenizer(None)
    names = list(VARIANTS) + ["base"]
    if a.smoke:
        names = ["base", *list(VARIANTS)[1:2], *list(VARIANTS)[-1:]]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{name}: C64 decode step (context 128, overlap on) per MoE launch shape", flush=True)
    rows = [measure(model_dir, tokenizer, n) for n in names]
    base = min(r["replay_us"] for r in rows if r["variant"] == "base")
    best = sorted((r for r in rows if r["variant"] != "base"), key=lambda r: r["replay_us"])[:2]
    print("== again: the best two beside base", flush=True)
    for n in ["base"] + [r["variant"] for r in best] + ["base"]:
        rows.append(measure(model_dir, tokenizer, n))
    (a.out / "moe_ab64.json").write_text(json.dumps(rows, indent=1))
    print(f"base replay (best of its runs) {base:.1f} us")


if __name__ == "__main__":
    main()
