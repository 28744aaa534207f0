"""mHC merge/mix launch shapes at the C64 decode step's 64 rows (D 4096, 4 streams, 24 mixes, v4-top2's six layers).

1. The step's chain of hyper kernels alone, for each shape: hc_mix, then per layer pre_norm -> merge_mix -> pre_norm
   -> merge_mix (stand-in block outputs), then head_norm: 13 merge/mix and 13 norm launches, as in the step. Checked
   against the reference chain (relative error of the head's output), then timed as a CUDA graph replay.
2. The C64 decode step itself (decode_batch's graph replay) on a fresh runner: the tree's shape (base) first and
   last, the best three shapes of the chain sweep between. Batch 1 for base.

A shape: ("row", block, rows, warps) for the tree's per-row kernel at that shape from 16 to 127 rows (warps for
every per-row launch); ("dot", block, rows, warps, sub) for the GEMM-tile kernel from 16 rows. `--part K/N` compiles
(and times, discarded) every N-th shape from K: processes side by side fill Triton's cache before the timed sweep.

    python .gpu/mix_sweep.py OUT [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from benchmarks.serving import gpu_real_job as rj  # noqa: E402
from evalpipe.engine.model.hyper import HyperConnection, HyperHead  # noqa: E402
from evalpipe.engine.tokenizer import load_tokenizer  # noqa: E402
from evalpipe.kernels import hyper as H  # noqa: E402

ORIG = {
    k: getattr(H, k)
    for k in (
        "mix_block",
        "_rows_per_program",
        "MIX_WARPS",
        "DOT_MIN_ROWS",
        "DOT_ROWS",
        "DOT_SUB",
        "DOT_WARPS",
    )
}


OLD = ("row", 128, 4, 4)  # the tree before: the old per-row kernel at its shape
SHAPES = [("base",), OLD]
for block in (32, 64):
    for rows in (2, 4, 8):
        for warps in (2, 4, 8):
            SHAPES.append(("row", block, rows, warps))
SHAPES += [("row", 128, 8, 4), ("row", 128, 8, 8), ("row", 128, 16, 8), ("row", 128, 2, 4)]
SHAPES += [("row", 128, 4, 8), ("row", 128, 2, 8)]
for block, rows, warps, sub in (
    (32, 16, 4, 32),
    (32, 32, 4, 32),
    (32, 64, 4, 32),
    (32, 64, 8, 32),
    (64, 16, 4, 32),
    (64, 16, 4, 64),
    (64, 32, 4, 64),
    (64, 64, 8, 64),
    (128, 16, 4, 64),
    (128, 32, 4, 64),
):
    SHAPES.append(("dot", block, rows, warps, sub))


def name(shape) -> str:
    return "base" if shape[0] == "base" else "-".join(str(x) for x in shape)


def set_shape(shape) -> None:
    """("row", block, rows, warps): the tree's per-row kernel at that shape from 16 to 127 rows; ("dot", ...): the
    GEMM-tile kernel from 16 rows."""
    for k, v in ORIG.items():
        setattr(H, k, v)
    if shape[0] == "base":
        return
    kind, block = shape[0], shape[1]

    def mix_block(D, T, invariant=False):
        if invariant or T < 16 or T >= ORIG["DOT_MIN_ROWS"]:
            return ORIG["mix_block"](D, T, invariant)
        return min(block, H._pow2(D))

    H.mix_block = mix_block
    if kind == "row":
        rows = shape[2]
        H._rows_per_program = lambda T: rows if 16 <= T < ORIG["DOT_MIN_ROWS"] else ORIG["_rows_per_program"](T)
        H.MIX_WARPS = shape[3]
        return
    rows, warps, sub = shape[2], shape[3], shape[4]
    H.DOT_MIN_ROWS, H.DOT_ROWS, H.DOT_WARPS, H.DOT_SUB = 16, rows, warps, sub


def make_chain(dev, D=4096, hc=4, layers=6, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    cfg = SimpleNamespace(hc_mult=hc, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    M = 2 * hc + hc * hc

    def conn():
        return HyperConnection(
            (torch.randn(M, hc * D, generator=g) / 64).to(dev),
            (0.5 * torch.randn(M, generator=g)).to(dev),
            (1 + 0.1 * torch.randn(3, generator=g)).to(dev),
            cfg,
        )

    conns = [(conn(), conn()) for _ in range(layers)]
    head = HyperHead(
        (torch.randn(hc, hc * D, generator=g) / 64).to(dev),
        (0.5 * torch.randn(hc, generator=g)).to(dev),
        (1 + 0.1 * torch.randn(1, generator=g)).to(dev),
        cfg,
    )
    norms = [(torch.rand(D, generator=g) + 0.5).to(dev) for _ in range(2 * layers + 1)]
    return conns, head, norms


def chain(streams, outs, conns, head, norms, backend):
    """The step's hyper kernels with stand-in block outputs (outs[i]: [T, D])."""
    kw = {"backend": backend}
    parts = H.hc_mix(streams, conns[0][0], **kw)
    i = 0
    for li, (attn_hc, ffn_hc) in enumerate(conns):
        post, comb, h = H.hc_pre_norm(streams, parts, attn_hc, norms[i], 1e-6, **kw)
        streams, parts = H.hc_merge_mix(streams, outs[i] + h, post, comb, ffn_hc, **kw)
        i += 1
        nxt = conns[li + 1][0] if li + 1 < len(conns) else head
        post, comb, h = H.hc_pre_norm(streams, parts, ffn_hc, norms[i], 1e-6, **kw)
        streams, parts = H.hc_merge_mix(streams, outs[i] + h, post, comb, nxt, **kw)
        i += 1
    return H.hc_head_norm(streams, parts, head, norms[i], 1e-6, **kw)


def micro(shape, dev, dtype, T=64, D=4096, reps=50) -> dict:
    set_shape(shape)
    conns, head, norms = make_chain(dev, D)
    g = torch.Generator(device="cpu").manual_seed(1)
    streams = torch.randn(T, 4, D, generator=g).to(dev, dtype)
    outs = [torch.randn(T, D, generator=g).to(dev, dtype) for _ in range(12)]
    ref = chain(streams, outs, conns, head, norms, "reference").float()
    got = chain(streams, outs, conns, head, norms, "triton").float()
    err = float((got - ref).abs().max() / ref.abs().max())
    finite = bool(torch.isfinite(got).all())
    us = float("nan")
    if dev == "cuda":
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                chain(streams, outs, conns, head, norms, "triton")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain(streams, outs, conns, head, norms, "triton")
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(5):
            a.record()
            for _ in range(reps):
                graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / reps)
        us = sorted(times)[len(times) // 2]
        del graph
    return {"shape": name(shape), "chain_us": round(us, 1), "rel_err": err, "finite": finite}


def step(model_dir: Path, tokenizer, shape) -> dict:
    set_shape(shape)
    t0 = time.perf_counter()
    runner, _ = rj.server_runner(model_dir)
    built = time.perf_counter() - t0
    r = rj.decode_batch(runner, tokenizer, 64, overlap=True)
    row = {"shape": name(shape), "step_wall_us": r["step_wall_us"], "replay_us": r["replay_us"]}
    if shape[0] == "base":  # the tree's and the kernel before: batch 1 too
        r1 = rj.decode_batch(runner, tokenizer, 1, overlap=True)
        row.update(c1_step_wall_us=r1["step_wall_us"], c1_replay_us=r1["replay_us"], c1_tok_s=r1["tok_s"])
        print(f"  C1 {name(shape):16s} wall {r1['step_wall_us']:7.1f} us, replay {r1['replay_us']:7.1f} us", flush=True)
    print(
        f"  step {name(shape):16s} wall {r['step_wall_us']:7.1f} us, replay {r['replay_us']:7.1f} us "
        f"(built in {built:.1f}s)",
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
    ap.add_argument("--no-step", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated shape names: an A/B of these instead of the sweep")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds for the chain sweep")
    ap.add_argument("--part", default="", help="K/N: compile (and time) every N-th shape from K, no step: a warm-up")
    a = ap.parse_args()
    rj.place("mix_sweep", a.smoke)
    dev, dtype = rj.DEVICE, getattr(torch, rj.DTYPE)
    shapes = SHAPES if not a.smoke else [SHAPES[0], SHAPES[1], SHAPES[-1]]
    if a.part:
        k, n = (int(x) for x in a.part.split("/"))
        shapes = shapes[k::n]
        a.no_step = True
    if a.only:  # an A/B of named shapes (base = the tree's own), alternating, twice each
        by = {name(sh): sh for sh in SHAPES}
        picked = [by[n] if n in by else ("base",) for n in a.only.split(",")]
        shapes = picked + picked
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{card}: mHC chain (13 merge/mix + 13 norm launches) at 64 rows, D 4096", flush=True)
    rows = []
    t0 = time.perf_counter()
    for shape in shapes:
        if time.perf_counter() - t0 > a.budget:
            print(f"  sweep budget {a.budget}s spent: {len(rows)} of {len(shapes)} shapes", flush=True)
            break
        try:
            r = micro(shape, dev, dtype, D=4096 if not a.smoke else 256)
        except Exception as exc:  # a shape Triton cannot compile (resources): recorded, the sweep goes on
            r = {"shape": name(shape), "chain_us": float("nan"), "error": f"{type(exc).__name__}: {exc}"[:200]}
        rows.append(r)
        print(f"  {json.dumps(r)}", flush=True)
    if not a.part:
        (a.out / "mix_sweep.json").write_text(json.dumps(rows, indent=1))
    ok = [r for r in rows if r.get("finite") and r.get("rel_err", 1) < 3e-2 and r["chain_us"] == r["chain_us"]]
    if a.part:
        return
    base = next(r for r in rows if r["shape"] == "base")
    best = sorted((r for r in ok if r["shape"] not in ("base", name(OLD))), key=lambda r: r["chain_us"])[:3]
    if a.only:
        best = [{"shape": n} for n in dict.fromkeys(name(sh) for sh in shapes) if n != "base"]
    print(f"base chain {base['chain_us']} us; best: {[(r['shape'], r['chain_us']) for r in best]}", flush=True)
    if a.no_step:
        return
    model_dir = a.out / "v4-top2"
    if not (model_dir / "config.json").exists():
        rj.write_checkpoint(model_dir, a.smoke)
    tokenizer = load_tokenizer(None)
    by_name = {name(s): s for s in shapes}
    by_name[name(OLD)] = OLD
    order = [("base",)] + [by_name[r["shape"]] for r in best] + [("base",)]
    if a.only:
        order = order + order[1:-1]
    steps = [step(model_dir, tokenizer, s) for s in order]
    (a.out / "mix_steps.json").write_text(json.dumps(steps, indent=1))


if __name__ == "__main__":
    main()
