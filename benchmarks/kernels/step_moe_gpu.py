"""GPU check and benchmark of evalpipe/kernels/moe.py (the decode/verify MoE block in 4 launches).

    PYTHONPATH=. python -m benchmarks.kernels.step_moe_gpu                 # H200: production shapes
    PYTHONPATH=. python -m benchmarks.kernels.step_moe_gpu --device cpu    # dry run: tiny shapes, TRITON_INTERPRET=1

Shapes: hidden 4096, moe_intermediate 2048, bf16, sqrtsoftplus router with correction bias; E 8 top-2 and E 16 top-6 (+1
shared expert); T in {1, 6, 32} rows. MoE objects are the engine's `MoE` over random state dicts on the GPU. Checks
(exit status 1 on any failure): route kernel == route_reference (indices exact, weights 1e-5); gate_up kernel and the
whole moe_forward against the fp32 references; moe_forward against the previous `StaticModel.moe` chain
(`PreviousChain`, the timed baseline) and the engine's `MoE.__call__` (same routing, outputs within bf16 tolerance),
with activations large enough that swiglu_limit clamps, and a hash layer. Timing: `--layers` MoE objects with their own
weights run back to back in one captured CUDA graph (weights are not L2-resident, like a real decode step), median of
event-timed replays / layers. The gate_up and down kernels are first timed alone over a few block configs; the best of
each is used for the table. The down candidates include `expert_groups` G > 1 (the experts split over G program groups,
fp32 partials summed by a second launch) and mode "rows" (a row per pick, summed per token by a second launch),
each checked against down_reference; the down kernel is also timed under
`invariant=True` (--deterministic: MM_INVARIANT's launch shapes at every T): "rows", the default, and "mm" for each G
of DN_INVARIANT_GROUPS. Weight bandwidth = bytes of the distinct picked experts + the shared expert + the router /
time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

# bf16 tolerances relative to the reference output's largest magnitude: the new path rounds once, the engine
# path rounds gate/up/h/w and routed + shared separately (a few 2**-8 relative steps)
TOL_REF = 1e-2
TOL_ENGINE = 3e-2


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CI check: the --device cpu dry run at E 8 top-2, without its block-size-only candidates and with the "
        "clamped inputs alone",
    )
    ap.add_argument("--replays", type=int, default=60)
    ap.add_argument("--layers", type=int, default=4, help="MoE objects per timed graph (distinct weights)")
    ap.add_argument("--ts", default="1,6,32,64", help="token counts (rows per step) to check and time on CUDA")
    ap.add_argument(
        "--shapes", default="8x2,16x6", help="routed experts x picks per token, on CUDA (E8 top-2: v4-top2)"
    )
    return ap.parse_args()


ARGS = parse()
if ARGS.smoke:
    ARGS.device = "cpu"
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import gpu_bench  # noqa: E402
from evalpipe.engine.model.moe import MoE  # noqa: E402
from evalpipe.kernels import moe as step_moe  # noqa: E402

CHECKS = gpu_bench.Checks()
FAILED, report, check, rel_diff = CHECKS.failed, CHECKS.report, CHECKS.check, CHECKS.rel_diff
DEV = torch.device(ARGS.device)
CUDA = DEV.type == "cuda"
if CUDA:
    D, INTER, DT, LAYERS = 4096, 2048, torch.bfloat16, ARGS.layers
    TS = tuple(int(t) for t in ARGS.ts.split(","))
    SHAPES = tuple(tuple(int(v) for v in shape.split("x")) for shape in ARGS.shapes.split(","))
    # candidates besides the module's own choice (None): variants of the kernel shape it picks at that T; block_t 64
    # puts a 64-row batch (the largest graph bucket) in one token block, so each expert's weights are read once
    GU_CFGS = {
        "gemv": [dict(mode="gemv", block_n=16, block_k=256), dict(mode="gemv", block_n=16, block_k=1024)],
        "mm": [
            dict(mode="mm", block_n=32, block_k=256, num_stages=3),
            dict(mode="mm", block_n=64, block_k=128, num_warps=8),
            dict(mode="mm", block_t=64, block_n=32, block_k=128),
            dict(mode="mm", block_t=64, block_m=32, block_n=32, block_k=128, num_warps=8),
            dict(mode="mm", block_t=64, block_m=64, block_n=64, block_k=64, num_warps=8),
        ],
    }
    # expert_groups G: G x the programs of a token block (at T 64, hidden 4096: 4096 / block_n x G; programs at T 64
    # in the comments), each walking (E + 1) / G experts; the fp32 partials add G x T x hidden x 8 bytes of traffic
    # (G x 2 MB at T 64) against the 151 MB of down weights of E 8 + 1 experts. Compiled for sm_90a without a GPU
    # (Triton 3.9, ptxas 13.4, 16-byte aligned pointers, Triton's default 3 stages), the 8-warp shapes take 229-255
    # registers per thread (one program per SM at a time) and two stages of tiles (32 KB at block_n 32 / block_k 128,
    # 48 KB at block_n 64): a program has one or two weight tiles (block_n x block_k x 2 bytes) in flight, so some
    # candidates also widen the tile.
    DN_G = dict(mode="mm", block_t=64, block_m=32)
    DN_R = dict(mode="rows", block_t=64, block_m=64)
    DN_ROWS = [
        dict(block_n=64, block_k=64, num_warps=8),
        dict(block_n=64, block_k=64, num_warps=8, maxnreg=128),
        dict(block_n=64, block_k=64, num_warps=8, maxnreg=128, num_stages=4),
        dict(block_n=64, block_k=128, num_warps=8),
        dict(block_n=128, block_k=64, num_warps=8),
        dict(block_n=128, block_k=128, num_warps=8),
        dict(block_n=32, block_k=128, num_warps=4),
        dict(block_m=32, block_n=64, block_k=128, num_warps=4),
    ]
    DN_CFGS = {
        "gemv": [dict(mode="gemv", block_n=8, block_k=1024), dict(mode="gemv", block_n=4, block_k=1024)],
        "mm": [
            dict(mode="mm", block_n=16, block_k=128),
            dict(mode="mm", block_n=16, block_k=512, num_stages=2),
            dict(mode="mm", block_t=64, block_n=16, block_k=256),
            dict(mode="mm", block_t=64, block_m=32, block_n=32, block_k=128, num_warps=8),
            dict(mode="mm", block_t=64, block_m=64, block_n=32, block_k=64, num_warps=8),
            dict(DN_G, block_n=32, block_k=128, num_warps=8, expert_groups=3),  # 384 programs, 8 KB tiles
            dict(DN_G, block_n=64, block_k=128, num_warps=8, expert_groups=3),  # 192, 16 KB
            dict(DN_G, block_n=64, block_k=256, num_warps=8, expert_groups=3),  # 192, 32 KB
            dict(DN_G, block_n=64, block_k=128, num_warps=8, expert_groups=9),  # 576, 16 KB
            dict(DN_G, block_n=64, block_k=256, num_warps=8, expert_groups=9),  # 576, 32 KB
            dict(DN_G, block_n=128, block_k=64, num_warps=8, expert_groups=9),  # 288, 16 KB
            dict(DN_G, block_n=128, block_k=128, num_warps=8, expert_groups=9),  # 288, 32 KB
            dict(DN_G, block_n=32, block_k=128, num_warps=4, expert_groups=9),  # 1152, 8 KB, 4 warps
            # mode "rows": expert-major like gate_up, one fp32 row per pick, then a sum over each token's picks.
            # Programs at T 64: (E + 1) x 4096 / block_n. Compiled for sm_90a without a GPU (Triton 3.9, ptxas
            # 13.4), registers per thread and shared memory: n 64/k 64/8 warps 138 (128 with maxnreg, no spills:
            # two programs per SM), 48 KB at 3 stages; n 64/k 128/8 warps 125, 96 KB; n 128/k 128/8 warps 180, 144 KB
            *[dict(DN_R, **c) for c in DN_ROWS],
        ],
    }
    DN_INVARIANT_GROUPS = (1, 3, 9)
else:
    D, INTER, DT, TS, LAYERS = 64, 32, torch.float32, (1, 6), 1
    SHAPES = ((8, 2), (16, 6))
    GU_CFGS = {m: [dict(mode=m, block_n=16, block_k=32)] for m in ("gemv", "mm")}
    DN_CFGS = {
        **GU_CFGS,
        "mm": GU_CFGS["mm"]
        + [dict(mode="mm", block_n=16, block_k=32, expert_groups=3), dict(mode="rows", block_n=16, block_k=32)],
    }
    DN_INVARIANT_GROUPS = (1, 3)
    if ARGS.smoke:  # CI: one shape, both T values (a decode row and a verify block), seconds in the interpreter
        SHAPES = ((8, 2),)
        # the candidates that only change block sizes run the kernel "auto" runs at T 1 and 6; down's expert_groups
        # and "rows" candidates take paths of their own
        GU_CFGS = {m: [] for m in GU_CFGS}
        DN_CFGS = {"gemv": [], "mm": DN_CFGS["mm"][1:]}
SCALES = ((8.0, "x*8, clamps active"),) if ARGS.smoke else ((1.0, "unit x"), (8.0, "x*8, clamps active"))
VOCAB, LIMIT = 1024, 10.0


def make_moe(E: int, K: int, seed: int, *, is_hash: bool = False) -> MoE:
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEV) * scale).to(DT)

    sd = {
        "gate.weight": rnd(E, D, scale=D**-0.5),
        "gate.e_score_correction_bias": 0.5 * torch.randn(E, generator=g, device=DEV),
        "experts.gate_up_proj": rnd(E, 2 * INTER, D, scale=D**-0.5),
        "experts.down_proj": rnd(E, D, INTER, scale=INTER**-0.5),
        "shared_experts.gate_proj.weight": rnd(INTER, D, scale=D**-0.5),
        "shared_experts.up_proj.weight": rnd(INTER, D, scale=D**-0.5),
        "shared_experts.down_proj.weight": rnd(D, INTER, scale=INTER**-0.5),
    }
    if is_hash:
        sd["gate.tid2eid"] = torch.randint(0, E, (VOCAB, K), generator=g, device=DEV)
    cfg = SimpleNamespace(
        num_experts_per_tok=K,
        scoring_func="sqrtsoftplus",
        routed_scaling_factor=1.5,
        swiglu_limit=LIMIT,
        hidden_act="silu",
    )
    return MoE(sd, "", cfg, is_hash)


class PreviousChain:
    """`StaticModel.moe` as it was before step_moe took over (the baseline this script times): the engine's router
    ops, two `baseline_ops.expert_gemv` launches with SwiGLU and the sum between them, the shared expert as two
    GEMMs."""

    def __init__(self):
        self._shared_gu = {}

    def moe(self, moe, x, input_ids):
        from tests.support import baseline_ops

        idx, w = moe.route(x, input_ids)
        T, K = idx.shape
        flat = idx.reshape(-1)
        gate, up = baseline_ops.expert_gemv(x, flat, moe.gate_up, x_div=K).chunk(2, dim=-1)
        h = moe._swiglu(gate, up)
        y = baseline_ops.expert_gemv(h, flat, moe.down, w.reshape(-1), out_dtype=torch.float32)
        routed = y.view(T, K, -1).sum(dim=1).to(x.dtype)
        g, u, d = moe.shared
        if id(moe) not in self._shared_gu:
            self._shared_gu[id(moe)] = torch.cat([g, u], dim=0)
        sg, su = F.linear(x, self._shared_gu[id(moe)]).chunk(2, dim=-1)
        return routed + F.linear(moe._swiglu(sg, su), d)


def same_routing(idx: torch.Tensor, eidx: torch.Tensor) -> torch.Tensor:
    """Per row: the same set of routed experts (engine top-k is unsorted)."""
    K = eidx.shape[1]
    return (idx[:, :K].long().sort(-1).values == eidx.long().sort(-1).values).all(-1)


def correctness(moe: MoE, hash_moe: MoE | None, T: int, tag: str) -> None:
    gen = torch.Generator(device=DEV).manual_seed(T)
    old = PreviousChain()
    for scale, what in SCALES:  # --smoke: the clamped inputs alone (the same calls, every check)
        x = (scale * torch.randn(T, D, generator=gen, device=DEV)).to(DT)
        ids = torch.randint(0, VOCAB, (T,), generator=gen, device=DEV)
        logits = F.linear(x, moe.router)
        idx, w = step_moe.route(moe, logits, ids, backend="triton")
        ridx, rw = step_moe.route_reference(moe, logits, ids)
        d, _ = rel_diff(w, rw)
        report(f"{tag} route ({what})", torch.equal(idx, ridx) and d < 1e-5, f"indices equal, w max abs {d:.2g}")
        h = step_moe.gate_up(moe, x, idx, backend="triton")
        check(f"{tag} gate_up vs reference ({what})", h, step_moe.gate_up_reference(moe, x, idx), TOL_REF)
        y = step_moe.moe_forward(moe, x, ids, backend="triton")
        check(f"{tag} moe_forward vs reference ({what})", y, step_moe.moe_forward_reference(moe, x, ids), TOL_REF)
        eidx, _ = moe.route(x, ids)
        agree = same_routing(idx, eidx)
        report(f"{tag} routing == engine top-k ({what})", bool(agree.all()), f"{int(agree.sum())}/{T} rows")
        check(f"{tag} moe_forward vs previous StaticModel.moe chain ({what})", y, old.moe(moe, x, ids), TOL_ENGINE)
        check(f"{tag} moe_forward vs engine MoE.__call__ ({what})", y, moe(x, ids), TOL_ENGINE)
    if hash_moe is not None:
        x = torch.randn(T, D, generator=gen, device=DEV).to(DT)
        ids = torch.randint(0, VOCAB, (T,), generator=gen, device=DEV)
        y = step_moe.moe_forward(hash_moe, x, ids, backend="triton")
        check(f"{tag} hash layer vs engine MoE.__call__", y, hash_moe(x, ids), TOL_ENGINE)


def timed(fn, replays: int) -> float:
    """us per call: CUDA-graph captured and replayed on CUDA (median of event-timed replays), eager on the CPU
    (after one untimed call, but with --smoke: the interpreter's times are not read)."""
    if not CUDA:
        if not ARGS.smoke:
            fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    return gpu_bench.replay_us(gpu_bench.capture(fn), replays)


def timed_or_inf(fn, name: str) -> float:
    """`timed`, or inf (printed) when a candidate config does not compile or launch: one bad candidate must not
    end the sweep."""
    try:
        return timed(fn, ARGS.replays)
    except Exception as exc:  # noqa: BLE001 - reported, the candidate is dropped
        print(f"  config {name} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return float("inf")


def count_kernels(fn, show: str | None = None) -> int | None:
    if not CUDA:
        return None
    names = gpu_bench.kernel_names(fn)
    if show:
        print(f"  {show}: " + ", ".join(n[:50] for n in names), flush=True)
    return len(names)


def weight_bytes(moe: MoE, idx: torch.Tensor) -> int:
    """Bytes one layer must read: distinct picked routed experts (gate_up + down), shared expert, router."""
    p = step_moe.prepare(moe)
    routed = torch.unique(idx[:, :-1]).numel()
    per = p.gate_up[0].numel() + p.down[0].numel()
    shared = sum(w.numel() for w in p.shared)
    return (routed * per + shared) * p.gate_up.element_size() + moe.router.numel() * moe.router.element_size()


SHORT = {"expert_groups": "G"}


def label(cfg) -> str:
    if cfg is None:
        return "auto"
    return ",".join(
        str(v) if k == "mode" else f"{SHORT.get(k, k[6:] if k.startswith('block_') else k)}={v}" for k, v in cfg.items()
    )


def down_us(tag: str, name: str, cfg: dict | None, moes, hs, idxs, ws) -> float:
    """us per layer of the down kernel with launch keywords `cfg` (inf if it fails), after a check of its output
    against down_reference when the candidate splits the experts (expert_groups) or is invariant."""

    def run():
        return [step_moe.down(m, h, i, w, backend="triton", **(cfg or {})) for m, h, i, w in zip(moes, hs, idxs, ws)]

    us = timed_or_inf(run, name) / LAYERS
    if us < float("inf") and cfg and ("expert_groups" in cfg or cfg.get("invariant") or cfg.get("mode") == "rows"):
        want = step_moe.down_reference(moes[0], hs[0], idxs[0], ws[0])
        check(f"{tag} down {name} vs reference", run()[0], want, TOL_REF)
    return us


def main() -> int:
    print(
        f"device {torch.cuda.get_device_name() if CUDA else 'cpu (TRITON_INTERPRET=1)'}, torch {torch.__version__}"
        f", hidden {D}, I {INTER}, {str(DT).replace('torch.', '')}, {LAYERS} layer(s) per timed graph",
        flush=True,
    )
    rows = []
    for E, K in SHAPES:
        moes = [make_moe(E, K, seed=10 * E + i) for i in range(LAYERS)]
        hash_moe = make_moe(E, K, seed=999, is_hash=True) if E == 8 else None
        old = PreviousChain()
        for T in TS:
            tag = f"E{E} top{K} T{T}"
            t0 = time.time()
            correctness(moes[0], hash_moe, T, tag)
            gen = torch.Generator(device=DEV).manual_seed(1000 + T)
            x = torch.randn(T, D, generator=gen, device=DEV).to(DT)
            ids = torch.randint(0, VOCAB, (T,), generator=gen, device=DEV)
            idxs = [step_moe.route(m, F.linear(x, m.router), ids)[0] for m in moes]
            hs = [step_moe.gate_up(m, x, i) for m, i in zip(moes, idxs)]
            ws = [step_moe.route(m, F.linear(x, m.router), ids)[1] for m in moes]
            gu_cfgs = [None] + GU_CFGS[step_moe._mode("auto", "gate_up", T)]
            dn_cfgs = [None] + DN_CFGS[step_moe._mode("auto", "down", T)]
            gu_t = {
                label(c): timed_or_inf(
                    lambda c=c: [step_moe.gate_up(m, x, i, backend="triton", **(c or {})) for m, i in zip(moes, idxs)],
                    label(c),
                )
                / LAYERS
                for c in gu_cfgs
            }
            dn_t = {label(c): down_us(tag, label(c), c, moes, hs, idxs, ws) for c in dn_cfgs}
            inv_t = {
                f"mm,G={g}": down_us(
                    tag, f"invariant,mm,G={g}", dict(invariant=True, mode="mm", expert_groups=g), moes, hs, idxs, ws
                )
                for g in DN_INVARIANT_GROUPS
            }
            inv_t["rows"] = down_us(tag, "invariant,rows", dict(invariant=True), moes, hs, idxs, ws)
            gu_best = min(gu_cfgs, key=lambda c: gu_t[label(c)])
            dn_best = min(dn_cfgs, key=lambda c: dn_t[label(c)])
            print(
                f"  {tag} gate_up us: "
                + ", ".join(f"{k} {v:.1f}" for k, v in gu_t.items())
                + f" -> best {label(gu_best)}",
                flush=True,
            )
            print(
                f"  {tag} down    us: "
                + ", ".join(f"{k} {v:.1f}" for k, v in dn_t.items())
                + f" -> best {label(dn_best)}",
                flush=True,
            )
            print(
                f"  {tag} down invariant (MM_INVARIANT shapes) us: "
                + ", ".join(f"{k} {v:.1f}" for k, v in inv_t.items())
                + f" -> best {min(inv_t, key=inv_t.get)}",
                flush=True,
            )

            def new_one(m):
                return step_moe.moe_forward(m, x, ids, backend="triton", gate_up_cfg=gu_best, down_cfg=dn_best)

            y_best = new_one(moes[0])
            check(f"{tag} best config vs reference", y_best, step_moe.moe_forward_reference(moes[0], x, ids), TOL_REF)
            old_us = timed(lambda: [old.moe(m, x, ids) for m in moes], ARGS.replays) / LAYERS
            new_us = timed(lambda: [new_one(m) for m in moes], ARGS.replays) / LAYERS
            default_us = (
                timed(lambda: [step_moe.moe_forward(m, x, ids, backend="triton") for m in moes], ARGS.replays) / LAYERS
            )
            k_old = count_kernels(lambda: old.moe(moes[0], x, ids))
            k_new = count_kernels(lambda: new_one(moes[0]), show=f"{tag} new path kernels" if E == 8 else None)
            nbytes = statistics.mean(weight_bytes(m, i) for m, i in zip(moes, idxs))
            rows.append(
                (
                    f"E{E} top{K}+1 T={T}",
                    old_us,
                    k_old,
                    new_us,
                    default_us,
                    k_new,
                    nbytes,
                    f"{label(gu_best)} | {label(dn_best)}",
                )
            )
            print(f"  ({time.time() - t0:.1f} s)", flush=True)

    print(
        "\nshape                old us  kernels  new us (best cfg)  new us (auto cfg)   kernels  ratio  "
        "weights MB  new TB/s  old TB/s  best gate_up | down config"
    )
    for name, o, ko, n, nd, kn, nb, cfg in rows:
        print(
            f"{name:<20} {o:7.1f}  {str(ko):>7}  {n:16.1f}  {nd:18.1f}  {str(kn):>7}  {o / n:5.2f}  "
            f"{nb / 1e6:10.1f}  {nb / n / 1e6:8.2f}  {nb / o / 1e6:8.2f}  {cfg}"
        )
    if FAILED:
        print(f"\nFAILED checks ({len(FAILED)}): " + "; ".join(FAILED))
        return 1
    print("\nall checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
