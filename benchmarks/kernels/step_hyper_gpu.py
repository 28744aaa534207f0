"""GPU check and benchmark of evalpipe/kernels/hyper.py (mHC between blocks in 2 kernels per block).

    PYTHONPATH=. python -m benchmarks.kernels.step_hyper_gpu                 # H200: production shapes, < 60 s
    PYTHONPATH=. python -m benchmarks.kernels.step_hyper_gpu --device cpu    # dry run: tiny shapes, TRITON_INTERPRET=1
    PYTHONPATH=. python -m benchmarks.kernels.step_hyper_gpu --detail        # also time each op alone
    PYTHONPATH=. python -m benchmarks.kernels.step_hyper_gpu --sweep         # also time launch-shape variants
    PYTHONPATH=. python -m benchmarks.kernels.step_hyper_gpu --sweep --tokens 64,3500   # a decode batch, a prompt chunk
    PYTHONPATH=. python -m benchmarks.kernels.step_hyper_gpu --sweep --tokens 64 --dot-min-rows 16  # GEMM tiles at 64

At hc 4, D 4096, bf16 streams, T in {1, 6, 32}: a 2-layer chain (4 blocks whose outputs are fixed random tensors,
then the head) run the previous StaticModel way (baseline_ops.hc_pre + rms_norm + hc_merge per block, HyperHead +
rms_norm) and the new way (hc_mix, then hc_pre_norm + hc_merge_mix per block, hc_head_norm). Checks: each Triton
kernel against its PyTorch reference; each new op against the old ops on the same inputs; the whole chain against
the old chain; two runs bitwise equal. Then both chains are CUDA-graph captured and replayed (median of event-timed
replays); one table: T, old us, kernels old, new us, kernels new, ratio. Exit status 1 on any failed check.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from types import SimpleNamespace

# bf16 tolerances (relative to the reference's largest magnitude): a bf16 rounding flip is 2**-8 relative, and
# flips in the streams feed the next blocks' mixes, so the chain gets the looser bound
TOL_OP = 1e-2
TOL_CHAIN = 3e-2
TOL_MIX = 1e-5  # post / comb (fp32) from the same streams; partials relative to their row's largest value


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="CI check: the --device cpu dry run")
    ap.add_argument("--sweep", action="store_true", help="also time mix_block / rows / warps variants")
    ap.add_argument("--detail", action="store_true", help="also time each op alone")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument(
        "--dot-min-rows",
        type=int,
        default=None,
        help="rows from which merge/mix runs as GEMM tiles (hyper.DOT_MIN_ROWS) for the whole run, checks included",
    )
    ap.add_argument(
        "--tokens",
        default=None,
        help="comma-separated T values (default 1,6,32 on CUDA; e.g. 64,3500 for a full decode batch and "
        "a five-shot prompt chunk)",
    )
    return ap.parse_args()


ARGS = parse()
if ARGS.smoke:
    ARGS.device = "cpu"
if ARGS.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from evalpipe.engine.model.hyper import HyperConnection, HyperHead  # noqa: E402
from evalpipe.kernels import hyper as step_hyper  # noqa: E402
from evalpipe.kernels.norm import rms_norm  # noqa: E402
from tests.support import baseline_ops  # noqa: E402

FAILED: list[str] = []
CHECKED: list[tuple[str, float, float, str, bool]] = []  # name, max abs, relative to max, tolerance, ok


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, *, exact: bool = False) -> None:
    got, want = got.float(), want.float()
    diff = (got - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item(), 1e-30) if want.numel() else 1.0
    ok = bool(torch.isfinite(got).all()) and got.shape == want.shape and (diff == 0 if exact else diff <= tol * scale)
    print(
        f"  {'ok  ' if ok else 'FAIL'} {name}: max abs {diff:.3g}, rel-to-max {diff / scale:.3g}"
        f" (tol {'exact' if exact else tol})"
    )
    CHECKED.append((name, diff, diff / scale, "exact" if exact else str(tol), ok))
    if not ok:
        FAILED.append(name)


def build(hc: int, D: int, layers: int, device, gen):
    cfg = SimpleNamespace(hc_mult=hc, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    M = 2 * hc + hc * hc

    def conn():
        return HyperConnection(
            (torch.randn(M, hc * D, generator=gen) / (hc * D) ** 0.5).to(device),
            (0.5 * torch.randn(M, generator=gen)).to(device),
            (1 + 0.1 * torch.randn(3, generator=gen)).to(device),
            cfg,
        )

    blocks = [(conn(), (1 + 0.1 * torch.randn(D, generator=gen)).to(device)) for _ in range(2 * layers)]
    head = HyperHead(
        (torch.randn(hc, hc * D, generator=gen) / (hc * D) ** 0.5).to(device),
        (0.5 * torch.randn(hc, generator=gen)).to(device),
        (1 + 0.1 * torch.randn(1, generator=gen)).to(device),
        cfg,
    )
    norm = (1 + 0.1 * torch.randn(D, generator=gen)).to(device)
    return blocks, head, norm


def old_chain(streams, outs, blocks, head, norm, eps, xs=None):
    """StaticModel.forward's mHC today, blocks replaced by fixed outputs."""
    for (hcm, w), out in zip(blocks, outs):
        post, comb, h = baseline_ops.hc_pre(hcm, streams)
        x = rms_norm(h, w, eps)
        if xs is not None:
            xs.append(x)
        streams = baseline_ops.hc_merge(streams, out, post, comb)
    return rms_norm(head(streams), norm, eps)


def new_chain(streams, outs, blocks, head, norm, eps, xs=None, backend="auto"):
    parts = step_hyper.hc_mix(streams, blocks[0][0], backend=backend)
    for i, ((hcm, w), out) in enumerate(zip(blocks, outs)):
        post, comb, x = step_hyper.hc_pre_norm(streams, parts, hcm, w, eps, backend=backend)
        if xs is not None:
            xs.append(x)
        nxt = blocks[i + 1][0] if i + 1 < len(blocks) else head
        streams, parts = step_hyper.hc_merge_mix(streams, out, post, comb, nxt, backend=backend)
    return step_hyper.hc_head_norm(streams, parts, head, norm, eps, backend=backend)


def checks(T, hc, D, dtype, device, gen):
    eps = 1e-6
    blocks, head, norm = build(hc, D, 2, device, gen)
    (h0, w0), (h1, _) = blocks[0], blocks[1]
    streams = torch.randn(T, hc, D, generator=gen).to(device, dtype)
    out = torch.randn(T, D, generator=gen).to(device, dtype)
    fn0 = h0.fn
    tag = f"T={T}"
    # kernels vs references
    parts = step_hyper.hc_mix(streams, h0, backend="triton")
    want = step_hyper.hc_mix_reference(streams, fn0)
    row = want.abs().amax(dim=(1, 2), keepdim=True)
    check(f"{tag} hc_mix vs reference", parts / row, want / row, TOL_MIX)
    got = step_hyper.hc_pre_norm(streams, parts, h0, w0, eps, backend="triton")
    ref = step_hyper.hc_pre_norm(streams, parts, h0, w0, eps, backend="reference")
    for name, g, r in zip(("post", "comb"), got[:2], ref[:2]):
        check(f"{tag} hc_pre_norm {name} vs reference", g, r, TOL_MIX)
    check(f"{tag} hc_pre_norm x vs reference", got[2], ref[2], TOL_OP)
    new, p2 = step_hyper.hc_merge_mix(streams, out, got[0], got[1], h1, backend="triton")
    new_r, p2_r = step_hyper.hc_merge_mix_reference(streams, out, got[0], got[1], h1.fn)
    check(f"{tag} hc_merge_mix streams vs reference", new, new_r, TOL_OP)
    row = p2_r.abs().amax(dim=(1, 2), keepdim=True)
    check(
        f"{tag} hc_merge_mix partials vs reference (same streams)",
        p2 / row,
        step_hyper.hc_mix_reference(new, h1.fn) / row,
        TOL_MIX,
    )
    # new ops vs the engine path they replace, same inputs
    post, comb, h = baseline_ops.hc_pre(h0, streams)
    check(f"{tag} hc_pre_norm post vs hc_pre", got[0], post, TOL_MIX)
    check(f"{tag} hc_pre_norm comb vs hc_pre", got[1], comb, TOL_MIX)
    check(f"{tag} hc_pre_norm x vs hc_pre + rms_norm", got[2], rms_norm(h, w0, eps), TOL_OP)
    check(f"{tag} hc_merge_mix streams vs hc_merge", new, baseline_ops.hc_merge(streams, out, got[0], got[1]), TOL_OP)
    mixes = torch.nn.functional.linear(new.flatten(1).float(), h1.fn)
    row = mixes.abs().amax(dim=1, keepdim=True)
    check(f"{tag} hc_merge_mix partials vs F.linear(new, fn)", p2.sum(1)[:, :-1] / row, mixes / row, TOL_MIX)
    head_parts = step_hyper.hc_mix(new, head, backend="triton")
    check(
        f"{tag} hc_head_norm vs HyperHead + rms_norm",
        step_hyper.hc_head_norm(new, head_parts, head, norm, eps),
        rms_norm(head(new), norm, eps),
        TOL_OP,
    )
    # chain vs chain, determinism
    outs = [torch.randn(T, D, generator=gen).to(device, dtype) for _ in blocks]
    xs_old, xs_new = [], []
    final_old = old_chain(streams, outs, blocks, head, norm, eps, xs_old)
    final_new = new_chain(streams, outs, blocks, head, norm, eps, xs_new, backend="triton")
    for i, (a, b) in enumerate(zip(xs_new, xs_old)):
        check(f"{tag} chain block {i} input vs old chain", a, b, TOL_CHAIN)
    check(f"{tag} chain head output vs old chain", final_new, final_old, TOL_CHAIN)
    again = new_chain(streams, outs, blocks, head, norm, eps, backend="triton")
    check(f"{tag} chain run twice", again, final_new, 0, exact=True)
    return streams, outs, blocks, head, norm, eps


def kernel_count(fn) -> str:
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return str(sum(1 for n in names if not n.lower().startswith(("memcpy", "memset"))))
    except Exception as e:  # pragma: no cover - profiler trouble must not hide the timings
        return f"n/a ({type(e).__name__})"


def graph_time(fn, replays: int) -> float:
    """Median us of one replay of fn captured in a CUDA graph (10 timed batches of `replays` // 10 replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    per = max(1, replays // 10)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(per):
            g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return statistics.median(times)


def main() -> int:
    if ARGS.dot_min_rows is not None:
        step_hyper.DOT_MIN_ROWS = ARGS.dot_min_rows
    cuda = ARGS.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for the interpreted dry run)")
        return 1
    device = torch.device(ARGS.device)
    hc, D, dtype = (4, 4096, torch.bfloat16) if cuda else (4, 64, torch.float32)
    Ts = tuple(int(t) for t in ARGS.tokens.split(",")) if ARGS.tokens else ((1, 6, 32) if cuda else (1, 6))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for T in Ts:
        print(f"checks T={T} hc={hc} D={D} {dtype}")
        streams, outs, blocks, head, norm, eps = checks(T, hc, D, dtype, device, gen)
        if not cuda:
            continue
        old = lambda: old_chain(streams, outs, blocks, head, norm, eps)  # noqa: E731
        new = lambda: new_chain(streams, outs, blocks, head, norm, eps)  # noqa: E731
        t_old, t_new = graph_time(old, ARGS.replays), graph_time(new, ARGS.replays)
        rows.append((T, t_old, kernel_count(old), t_new, kernel_count(new)))
        if ARGS.detail:
            detail(T, streams, outs, blocks, head, norm, eps)
        if ARGS.sweep:
            sweep(T, new)
    if rows:
        n = len(blocks)
        print(f"\n2-layer mHC chain ({n} blocks + head), hc {hc}, D {D}, bf16, CUDA-graph replay, median us")
        print(
            f"{'T':>4} {'old us':>9} {'kernels old':>12} {'new us':>9} {'kernels new':>12} {'ratio':>7}"
            f" {'old/block':>10} {'new/block':>10}"
        )
        for T, a, ka, b, kb in rows:
            print(
                f"{T:>4} {a:>9.1f} {ka:>12} {b:>9.1f} {kb:>12} {a / b:>7.2f} {a / (n + 1):>10.2f} {b / (n + 1):>10.2f}"
            )
    print(f"\n{len(CHECKED)} checks\n| check | max abs | rel to max | tol | ok |\n|---|---:|---:|---:|---|")
    for name, diff, rel, tol, ok in CHECKED:
        print(f"| {name} | {diff:.3g} | {rel:.3g} | {tol} | {'ok' if ok else 'FAIL'} |")
    print("\nFAILED: " + ", ".join(FAILED) if FAILED else "\nall checks passed")
    return 1 if FAILED else 0


def detail(T, streams, outs, blocks, head, norm, eps) -> None:
    """Each op alone: 20 launches captured in one graph, us per launch."""
    (h0, w0), (h1, _) = blocks[0], blocks[1]
    out = outs[0]
    post, comb, h = baseline_ops.hc_pre(h0, streams)
    parts = step_hyper.hc_mix(streams, h0)
    hparts = step_hyper.hc_mix(streams, head)
    ops = {
        "old hc_pre (+ .float + GEMV)": lambda: baseline_ops.hc_pre(h0, streams),
        "old rms_norm": lambda: rms_norm(h, w0, eps),
        "old hc_merge": lambda: baseline_ops.hc_merge(streams, out, post, comb),
        "old head + rms_norm": lambda: rms_norm(head(streams), norm, eps),
        "new hc_mix": lambda: step_hyper.hc_mix(streams, h0),
        "new hc_pre_norm": lambda: step_hyper.hc_pre_norm(streams, parts, h0, w0, eps),
        "new hc_merge_mix": lambda: step_hyper.hc_merge_mix(streams, out, post, comb, h1),
        "new hc_head_norm": lambda: step_hyper.hc_head_norm(streams, hparts, head, norm, eps),
    }
    for name, op in ops.items():
        print(f"  T={T} {name}: {graph_time(lambda: [op() for _ in range(20)], 50) / 20:.2f} us")
    keep = step_hyper.NORM_SPLIT
    step_hyper.NORM_SPLIT = False
    print(
        f"  T={T} new hc_pre_norm unsplit: "
        f"{graph_time(lambda: [ops['new hc_pre_norm']() for _ in range(20)], 50) / 20:.2f} us"
    )
    step_hyper.NORM_SPLIT = keep


def sweep(T: int, new) -> None:
    """Time the new chain under other launch shapes (results do not change with rows, warps or the split; the
    block size changes the partials' blocking only). From DOT_MIN_ROWS rows the merge/mix is the GEMM-tile kernel,
    whose own tile (rows, columns, warps) is swept instead."""
    if T >= step_hyper.DOT_MIN_ROWS:
        keep_dot = (step_hyper.DOT_ROWS, step_hyper.DOT_SUB, step_hyper.DOT_WARPS)
        print(f"  sweep T={T}: GEMM tile rows columns warps -> us")
        try:
            for rows in (16, 32, 64):
                for sub in (32, 64, 128):
                    for warps in (4, 8):
                        step_hyper.DOT_ROWS, step_hyper.DOT_SUB, step_hyper.DOT_WARPS = rows, sub, warps
                        print(f"    {rows:>3} {sub:>4} {warps:>2} -> {graph_time(new, 20):.1f}", flush=True)
        finally:
            step_hyper.DOT_ROWS, step_hyper.DOT_SUB, step_hyper.DOT_WARPS = keep_dot
    keep = (
        step_hyper.mix_block,
        step_hyper._rows_per_program,
        step_hyper.MIX_WARPS,
        step_hyper.NORM_WARPS,
        step_hyper.NORM_SPLIT,
    )
    print(f"  sweep T={T}: block rows mix_warps -> us")
    try:
        for block in (32, 64, 128) + ((256,) if T >= 256 else ()):
            for r in (1, 4, 16) + ((64,) if T >= 256 else ()):
                for mw in (4, 8):
                    step_hyper.mix_block = lambda D, _T, _invariant=False, b=block: min(b, step_hyper._pow2(D))
                    step_hyper._rows_per_program = lambda _T, r=r: r
                    step_hyper.MIX_WARPS = mw
                    print(f"    {block:>4} {r:>2} {mw:>2} -> {graph_time(new, 100):.1f}")
        step_hyper.mix_block, step_hyper._rows_per_program, step_hyper.MIX_WARPS = keep[:3]
        for split in (False, True):
            for nw in (4, 8, 16):
                step_hyper.NORM_WARPS, step_hyper.NORM_SPLIT = nw, split
                print(f"    norm split {split} warps {nw:>2} -> {graph_time(new, 100):.1f}")
    finally:
        (
            step_hyper.mix_block,
            step_hyper._rows_per_program,
            step_hyper.MIX_WARPS,
            step_hyper.NORM_WARPS,
            step_hyper.NORM_SPLIT,
        ) = keep


if __name__ == "__main__":
    sys.exit(main())
