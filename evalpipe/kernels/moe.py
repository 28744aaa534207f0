"""The MoE block of a decode/verify step in 4 or 5 launches: router GEMM, route kernel, gate_up kernel, down kernel
(and a sum, where down writes a row per pick or splits its experts into groups).

As torch ops the block is ~25 kernels per layer (router, score, bias, topk, gather, normalise, expert GEMVs,
chunk/clamp/silu/mul, shared gate|up and down GEMMs, sums, casts, add), and the eager MoE reads expert counts back
to the host, which a CUDA graph cannot contain. Here the shared expert is
just one more pick: the route kernel appends it as column K of every token's picks (index E, weight 1.0), so one
gate_up kernel and one down kernel serve routed and shared experts alike. Below DOWN_ROWS_FROM rows the down
kernel sums a token's K+1 picks in registers (no [T, K, D] intermediate, no separate add); from there it writes an
fp32 row per pick and a second launch adds them ("rows", faster at 64 rows).

`StaticModel.moe` (engine/static/model.py) calls `moe_forward(moe, x, input_ids, backend=...)` with the engine's
`MoE` layer object (router, gate_up, down, shared, top_k, scoring, scaling, limit, bias, tid2eid, is_hash, act).

Per-layer preparation is automatic and one-off: the first call for a MoE object caches (keyed by the object's
identity, weakly, so the entry goes with the object) contiguous views of its weights and its kernel flags. Nothing
is copied: the kernels pick the shared expert's weights (moe.shared[0..2]) by pointer when a pick's index is E,
instead of concatenating [E+1, 2I, D] / [E+1, D, I] tensors -- that concatenation would duplicate every routed
expert's weights in GPU memory.

Math (= engine `MoE.__call__`):
- scores = scoring_func(logits), computed in fp32 and rounded to the logits' dtype after each op where the engine's
  torch chain rounds (softplus, then sqrt; sigmoid; softmax), so the top-k sees the engine's scores;
- top-k of scores + e_score_correction_bias (fp32). Ties: the lowest expert index first (as a stable descending
  sort would order them); torch.topk leaves ties unspecified. NaN scores are undefined but always give in-range
  indices. Hash layers take tid2eid[input_ids] instead (no bias);
- w = gathered unbiased scores / (sum + 1e-20) * routed_scaling_factor, kept in fp32 (the engine rounds w to the
  activation dtype);
- h = act(gate.clamp(max=limit)) * up.clamp(-limit, limit) from fp32 gate/up accumulators, rounded once to
  x.dtype (the engine rounds gate and up first), act = SiLU (other activations fall back to the reference);
- y[t] = sum_j w[t, j] * W_down[idx[t, j]] @ h[t, j] over the K+1 picks, fp32 accumulation, one rounding to
  x.dtype. The engine rounds the routed sum and the shared output separately and adds them in x.dtype; the
  difference is one bf16 rounding step, inside bf16 tolerance.

Kernel shapes: few tokens (T=1 decode) stream each pick's weights with GEMV programs (coalesced 16-byte loads
along the reduction dim, ~2+ programs per SM); from a few tokens on, expert-major tl.dot kernels read each picked
expert once per token block of up to 32 tokens (MM_MIN_TOKENS). Their grids have E+1 expert programs per channel
block, idle ones exit at once: cheap for E 8..16, not tuned for E 256. The down kernel's programs walk the
experts instead (a token's picks summed in registers); `expert_groups` splits that walk over more programs
(`down`). Mode "rows" runs down expert-major too (a row per pick, summed by a second launch); "auto" takes it from
DOWN_ROWS_FROM tokens on, when that is set. First H200 run (hidden 4096, I 2048, bf16,
4 layers per captured graph, benchmarks/kernels/step_moe_gpu.py, before the heuristics below were retuned from it): E
8 top-2
T=1 56 us vs 118 us for the StaticModel chain (27
kernels -> 5 counted by the profiler: 3 Triton + the router GEMM, which cuBLAS presumably runs as split-K + reduce;
the benchmark prints their names), 2.7 TB/s of picked weights; T=32 1.6x; E 16 top-6 T=32 4.2x.

Triton path: no host synchronisation, fixed shapes (CUDA-graph capturable). `backend="auto"` runs it on CUDA
tensors, the reference elsewhere; "triton" forces it (CPU needs TRITON_INTERPRET=1); "reference" forces torch.
Kernels are built on first use, so a test that sets TRITON_INTERPRET=1 runs them interpreted. `score` is the
engine's own scoring chain (engine/model/moe.py imports it).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from evalpipe.kernels._backend import interpret_mode, jit, use_triton
from evalpipe.kernels.batch_invariant import split_sum, tile_dot

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None

SCORING = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
TARGET_PROGRAMS = 264  # ~2 programs per H200 SM (132): enough loads in flight to approach HBM bandwidth


# ---- kernel sources (built on first use by `jit`) -------------------------------------------------------------

if tl is not None:

    def _route_kernel(
        logits_ptr,
        bias_ptr,
        ids_ptr,
        tid2eid_ptr,
        idx_ptr,
        w_ptr,
        E,
        scaling,
        K: tl.constexpr,
        SCORING: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        IS_HASH: tl.constexpr,
        ROUND: tl.constexpr,
        BLOCK_E: tl.constexpr,
        K_PAD: tl.constexpr,
    ):
        t = tl.program_id(0)
        es = tl.arange(0, BLOCK_E)
        em = es < E
        lin = tl.load(logits_ptr + t * E + es, mask=em, other=0.0)
        dt = lin.dtype
        lg = lin.to(tl.float32)
        if SCORING == 0:  # sqrt(softplus): torch's softplus is the identity past 20
            u = tl.exp(-tl.abs(lg))
            v = 1.0 + u
            log1p = tl.where(v == 1.0, u, tl.log(v) * (u / tl.where(v == 1.0, 1.0, v - 1.0)))  # log1p, no libdevice
            sp = tl.where(lg > 20.0, lg, tl.maximum(lg, 0.0) + log1p)
            if ROUND:
                sp = sp.to(dt).to(tl.float32)
            s = tl.sqrt(sp)
        elif SCORING == 1:
            s = 1.0 / (1.0 + tl.exp(-lg))
        else:
            z = tl.where(em, lg, float("-inf"))
            ex = tl.exp(z - tl.max(z, axis=0))
            s = ex / tl.sum(ex, axis=0)
        if ROUND:
            s = s.to(dt).to(tl.float32)
        ks = tl.arange(0, K_PAD)
        picks = tl.zeros([K_PAD], dtype=tl.int32)
        if IS_HASH:
            tok = tl.load(ids_ptr + t).to(tl.int64)
            picks = tl.load(tid2eid_ptr + tok * K + ks, mask=ks < K, other=0).to(tl.int32)
        else:
            b = s
            if HAS_BIAS:
                b = b + tl.load(bias_ptr + es, mask=em, other=0.0)
            avail = em
            for k in tl.static_range(K):
                m = tl.max(tl.where(avail, b, float("-inf")), axis=0)
                e = tl.min(tl.where(avail & (b == m), es, BLOCK_E), axis=0)
                e = tl.where(e < BLOCK_E, e, tl.min(tl.where(avail, es, BLOCK_E), axis=0))  # NaN: stay in range
                picks = tl.where(ks == k, e, picks)
                avail = avail & (es != e)
        hit = (picks[:, None] == es[None, :]) & (ks < K)[:, None]
        ws = tl.sum(tl.where(hit, s[None, :], 0.0), axis=1)  # [K_PAD] unbiased scores of the picks
        ws = ws / (tl.sum(ws, axis=0) + 1e-20) * scaling
        out = t * (K + 1)
        tl.store(idx_ptr + out + ks, picks, mask=ks < K)
        tl.store(w_ptr + out + ks, ws, mask=ks < K)
        tl.store(idx_ptr + out + K, E)  # the shared expert, weight 1
        tl.store(w_ptr + out + K, 1.0)

    def _gate_up_kernel(
        x_ptr,
        idx_ptr,
        gu_ptr,
        sg_ptr,
        su_ptr,
        h_ptr,
        R,
        E,
        limit,
        D: tl.constexpr,
        I: tl.constexpr,
        KP1: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One pick row r, BLOCK_N output channels: gate rows j and up rows I + j in the same program, so the
        SwiGLU happens in registers. Rows vary fastest over program ids: programs running together share a
        channel block, so rows that picked the same expert find its weights in L2."""
        pid = tl.program_id(0)
        r = pid % R
        n0 = (pid // R) * BLOCK_N
        e = tl.load(idx_ptr + r)
        routed = gu_ptr + e.to(tl.int64) * (2 * I * D)
        gbase = tl.where(e == E, sg_ptr, routed)
        ubase = tl.where(e == E, su_ptr, routed + I * D)
        ns = n0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        nm = ns < I
        woff = ns[:, None].to(tl.int64) * D + ks[None, :]
        xrow = x_ptr + (r // KP1).to(tl.int64) * D
        accg = tl.zeros([BLOCK_N], dtype=tl.float32)
        accu = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if D % BLOCK_K == 0:
                xv = tl.load(xrow + k0 + ks).to(tl.float32)
                if I % BLOCK_N == 0:
                    g = tl.load(gbase + woff + k0)
                    u = tl.load(ubase + woff + k0)
                else:
                    g = tl.load(gbase + woff + k0, mask=nm[:, None], other=0.0)
                    u = tl.load(ubase + woff + k0, mask=nm[:, None], other=0.0)
            else:
                km = k0 + ks < D
                xv = tl.load(xrow + k0 + ks, mask=km, other=0.0).to(tl.float32)
                g = tl.load(gbase + woff + k0, mask=nm[:, None] & km[None, :], other=0.0)
                u = tl.load(ubase + woff + k0, mask=nm[:, None] & km[None, :], other=0.0)
            accg += tl.sum(g.to(tl.float32) * xv[None, :], axis=1)
            accu += tl.sum(u.to(tl.float32) * xv[None, :], axis=1)
        g = tl.minimum(accg, limit)
        u = tl.minimum(tl.maximum(accu, -limit), limit)
        h = g / (1.0 + tl.exp(-g)) * u  # silu(g) * u
        tl.store(h_ptr + r.to(tl.int64) * I + ns, h.to(h_ptr.dtype.element_ty), mask=nm)

    def _down_kernel(
        h_ptr,
        idx_ptr,
        w_ptr,
        dn_ptr,
        sd_ptr,
        y_ptr,
        T,
        E,
        D: tl.constexpr,
        I: tl.constexpr,
        KP1: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """One token, BLOCK_N output channels, all K+1 picks summed in fp32 registers, one rounding."""
        pid = tl.program_id(0)
        t = pid % T
        n0 = (pid // T) * BLOCK_N
        ns = n0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        nm = ns < D
        woff = ns[:, None].to(tl.int64) * I + ks[None, :]
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(KP1):
            r = t * KP1 + j
            e = tl.load(idx_ptr + r)
            wj = tl.load(w_ptr + r)
            base = tl.where(e == E, sd_ptr, dn_ptr + tl.cast(e, tl.int64) * (D * I))
            hrow = h_ptr + r.to(tl.int64) * I
            part = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, I, BLOCK_K):
                if I % BLOCK_K == 0:
                    hv = tl.load(hrow + k0 + ks).to(tl.float32)
                    if D % BLOCK_N == 0:
                        wt = tl.load(base + woff + k0)
                    else:
                        wt = tl.load(base + woff + k0, mask=nm[:, None], other=0.0)
                else:
                    km = k0 + ks < I
                    hv = tl.load(hrow + k0 + ks, mask=km, other=0.0).to(tl.float32)
                    wt = tl.load(base + woff + k0, mask=nm[:, None] & km[None, :], other=0.0)
                part += tl.sum(wt.to(tl.float32) * hv[None, :], axis=1)
            acc += wj * part
        tl.store(y_ptr + t.to(tl.int64) * D + ns, acc.to(y_ptr.dtype.element_ty), mask=nm)

    def _pick_slots(sel, pos, lr, m0, ms):
        """The slots (lr) of a token block's picks m0 .. m0 + BLOCK_M - 1 of one expert, in slot order: `sel` marks
        the slots that picked it and `pos` is each marked slot's place among them. Places past the expert's last
        pick get slot 0, which the caller masks. The expert-major kernels multiply those pick rows BLOCK_M at a
        time."""
        hit = sel[None, :] & (pos[None, :] == (m0 + ms)[:, None])
        return tl.sum(tl.where(hit, lr[None, :], 0), axis=1)

    def _gate_up_mm_kernel(
        x_ptr,
        idx_ptr,
        gu_ptr,
        sg_ptr,
        su_ptr,
        h_ptr,
        T,
        E,
        limit,
        D: tl.constexpr,
        I: tl.constexpr,
        KP1: tl.constexpr,
        BLOCK_T: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        ROWWISE: tl.constexpr,
    ):
        """Expert-major: program (e, channel block, token block) compacts the pick rows of its token block that
        chose expert e and multiplies them BLOCK_M at a time with tl.dot, so each expert's weights are read once
        per token block instead of once per pick. Experts nobody picked read nothing."""
        e = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        r0 = tl.program_id(2) * (BLOCK_T * KP1)
        lr = tl.arange(0, R_PAD)
        live = (lr < BLOCK_T * KP1) & (r0 + lr < T * KP1)
        sel = live & (tl.load(idx_ptr + r0 + lr, mask=live, other=-1) == e)
        cnt = tl.sum(sel.to(tl.int32), axis=0)
        if cnt > 0:
            pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
            routed = gu_ptr + e.to(tl.int64) * (2 * I * D)
            gbase = tl.where(e == E, sg_ptr, routed)
            ubase = tl.where(e == E, su_ptr, routed + I * D)
            ns = n0 + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            ms = tl.arange(0, BLOCK_M)
            nm = ns < I
            woff = ns[None, :].to(tl.int64) * D + ks[:, None]  # [BLOCK_K, BLOCK_N], unit stride along k
            for m0 in range(0, cnt, BLOCK_M):
                row = r0 + _pick_slots(sel, pos, lr, m0, ms)  # [BLOCK_M] compacted pick rows
                mv = m0 + ms < cnt
                xrow = x_ptr + (row // KP1).to(tl.int64)[:, None] * D
                accg = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                accu = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, D, BLOCK_K):
                    km = k0 + ks < D
                    xt = tl.load(xrow + k0 + ks[None, :], mask=mv[:, None] & km[None, :], other=0.0)
                    g = tl.load(gbase + woff + k0, mask=km[:, None] & nm[None, :], other=0.0)
                    u = tl.load(ubase + woff + k0, mask=km[:, None] & nm[None, :], other=0.0)
                    xt = xt.to(g.dtype)
                    accg = tile_dot(xt, g, accg, IEEE, ROWWISE)  # IEEE: float32 weights, exact products
                    accu = tile_dot(xt, u, accu, IEEE, ROWWISE)
                g = tl.minimum(accg, limit)
                u = tl.minimum(tl.maximum(accu, -limit), limit)
                h = g / (1.0 + tl.exp(-g)) * u
                tl.store(
                    h_ptr + row.to(tl.int64)[:, None] * I + ns[None, :],
                    h.to(h_ptr.dtype.element_ty),
                    mask=mv[:, None] & nm[None, :],
                )

    def _down_tile(
        h_ptr,
        base,
        woff,
        row,
        ks,
        mv,
        nm,
        I: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        ROWWISE: tl.constexpr,
    ):
        """[BLOCK_M, BLOCK_N] fp32: the pick rows `row` of h (live where `mv`) times one expert's down weights at
        `base` (`woff`: the channel block's offsets of a [BLOCK_K, BLOCK_N] tile), walked along I in BLOCK_K
        steps."""
        hrow = h_ptr + row.to(tl.int64)[:, None] * I
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            km = k0 + ks < I
            ht = tl.load(hrow + k0 + ks[None, :], mask=mv[:, None] & km[None, :], other=0.0)
            wt = tl.load(base + woff + k0, mask=km[:, None] & nm[None, :], other=0.0)
            acc = tile_dot(ht.to(wt.dtype), wt, acc, IEEE, ROWWISE)
        return acc

    def _down_mm_kernel(
        h_ptr,
        idx_ptr,
        w_ptr,
        dn_ptr,
        sd_ptr,
        y_ptr,
        part_ptr,
        T,
        E,
        D: tl.constexpr,
        I: tl.constexpr,
        KP1: tl.constexpr,
        BLOCK_T: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUPS: tl.constexpr,
        IEEE: tl.constexpr,
        ROWWISE: tl.constexpr,
    ):
        """Program (channel block, token block, expert group) walks its group's experts; for each, the compacted
        pick rows that chose it go through tl.dot, are scaled by their routing weight and added to their token's
        fp32 row through a one-hot [BLOCK_T, BLOCK_M] matrix (an exact fp32 dot) -- the sum over picks stays in
        registers. GROUPS == 1: one group of all E + 1 experts, rounded once into y. GROUPS > 1: group g holds the
        contiguous experts [g (E+1) / GROUPS, (g+1) (E+1) / GROUPS) (the shared expert, E, in the last) and stores
        its fp32 sum into part [GROUPS, T, D]; the caller sums the groups in order and rounds once. A pick row with
        a NaN/inf reaches its own token only (in the one-hot dot, 0 * inf would spread it over the token block)."""
        n0 = tl.program_id(0) * BLOCK_N
        t0 = tl.program_id(1) * BLOCK_T
        g = tl.program_id(2)
        if GROUPS == 1:
            e_lo = 0
            e_hi = E + 1
        else:
            e_lo = g * (E + 1) // GROUPS
            e_hi = (g + 1) * (E + 1) // GROUPS
        r0 = t0 * KP1
        lr = tl.arange(0, R_PAD)
        live = (lr < BLOCK_T * KP1) & (r0 + lr < T * KP1)
        ridx = tl.load(idx_ptr + r0 + lr, mask=live, other=-1)
        ns = n0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        ms = tl.arange(0, BLOCK_M)
        ts = tl.arange(0, BLOCK_T)
        nm = ns < D
        woff = ns[None, :].to(tl.int64) * I + ks[:, None]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for e in range(e_lo, e_hi):
            sel = live & (ridx == e)
            cnt = tl.sum(sel.to(tl.int32), axis=0)
            if cnt > 0:
                pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
                base = tl.where(e == E, sd_ptr, dn_ptr + tl.cast(e, tl.int64) * (D * I))
                for m0 in range(0, cnt, BLOCK_M):
                    lrow = _pick_slots(sel, pos, lr, m0, ms)
                    mv = m0 + ms < cnt
                    part = _down_tile(
                        h_ptr, base, woff, r0 + lrow, ks, mv, nm, I, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, ROWWISE
                    )
                    part = part * tl.load(w_ptr + r0 + lrow, mask=mv, other=0.0)[:, None]
                    onehot = (((lrow // KP1)[None, :] == ts[:, None]) & mv[None, :]).to(tl.float32)
                    finite = tl.abs(part) < float("inf")
                    acc = tl.dot(onehot, tl.where(finite, part, 0.0), acc, input_precision="ieee")
                    if tl.max(tl.where(finite, 0, 1)) > 0:  # rare: count each token's non-finite picks instead
                        pinf = tl.dot(onehot, (part == float("inf")).to(tl.float32), input_precision="ieee")
                        ninf = tl.dot(onehot, (part == float("-inf")).to(tl.float32), input_precision="ieee")
                        nan = tl.dot(onehot, (part != part).to(tl.float32), input_precision="ieee")
                        acc = tl.where(pinf > 0, acc + float("inf"), acc)
                        acc = tl.where(ninf > 0, acc - float("inf"), acc)
                        acc = tl.where(nan > 0, float("nan"), acc)
        rows = (t0 + ts).to(tl.int64)[:, None] * D + ns[None, :]
        keep = (t0 + ts < T)[:, None] & nm[None, :]
        if GROUPS == 1:
            tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(part_ptr + g.to(tl.int64) * T * D + rows, acc, mask=keep)

    def _down_rows_kernel(
        h_ptr,
        idx_ptr,
        w_ptr,
        dn_ptr,
        sd_ptr,
        part_ptr,
        T,
        E,
        D: tl.constexpr,
        I: tl.constexpr,
        KP1: tl.constexpr,
        BLOCK_T: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
        ROWWISE: tl.constexpr,
    ):
        """Expert-major like `_gate_up_mm_kernel`: program (e, channel block, token block) multiplies the compacted
        pick rows of its token block that chose expert e with tl.dot, scales each by its routing weight and stores
        it as pick row r of the fp32 part [T * KP1, D]; the caller sums each token's KP1 rows in pick order and
        rounds once. Each expert's weights are read once per token block, and a program holds one dot tile, not a
        token block's running sums: the registers `_down_mm_kernel` spends on those go to wider weight tiles."""
        e = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        r0 = tl.program_id(2) * (BLOCK_T * KP1)
        lr = tl.arange(0, R_PAD)
        live = (lr < BLOCK_T * KP1) & (r0 + lr < T * KP1)
        sel = live & (tl.load(idx_ptr + r0 + lr, mask=live, other=-1) == e)
        cnt = tl.sum(sel.to(tl.int32), axis=0)
        if cnt > 0:
            pos = tl.cumsum(sel.to(tl.int32), axis=0) - 1
            base = tl.where(e == E, sd_ptr, dn_ptr + e.to(tl.int64) * (D * I))
            ns = n0 + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            ms = tl.arange(0, BLOCK_M)
            nm = ns < D
            woff = ns[None, :].to(tl.int64) * I + ks[:, None]  # [BLOCK_K, BLOCK_N], unit stride along k
            for m0 in range(0, cnt, BLOCK_M):
                row = r0 + _pick_slots(sel, pos, lr, m0, ms)  # [BLOCK_M] compacted pick rows
                mv = m0 + ms < cnt
                acc = _down_tile(h_ptr, base, woff, row, ks, mv, nm, I, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, ROWWISE)
                acc = acc * tl.load(w_ptr + row, mask=mv, other=0.0)[:, None]
                tl.store(part_ptr + row.to(tl.int64)[:, None] * D + ns[None, :], acc, mask=mv[:, None] & nm[None, :])


# ---- per-MoE preparation ---------------------------------------------------------------------------------------


class _Prepared:
    """What the kernels need from one engine MoE object, computed once."""

    def __init__(self, moe):
        self.gate_up = moe.gate_up.contiguous()
        self.down = moe.down.contiguous()
        self.shared = [w.contiguous() for w in moe.shared]
        self.router = moe.router
        self.E, two_i, self.D = self.gate_up.shape
        self.I = two_i // 2
        self.K = moe.top_k
        self.limit = float("inf") if moe.limit is None else float(moe.limit)
        self.bias = moe.bias.float().contiguous() if moe.bias is not None else None
        self.tid2eid = moe.tid2eid.contiguous() if moe.is_hash else None
        sg, su, sd = self.shared
        probe = torch.linspace(-30.0, 30.0, 241)
        is_silu = torch.allclose(moe.act(probe), F.silu(probe), rtol=1e-6, atol=1e-6)  # hidden_act name is gone
        self.kernel_ok = (
            is_silu
            and moe.scoring in SCORING
            and sg.shape == su.shape == (self.I, self.D)
            and sd.shape == (self.D, self.I)
            and self.down.shape == (self.E, self.D, self.I)
            and len({self.gate_up.dtype, self.down.dtype, sg.dtype, su.dtype, sd.dtype}) == 1
        )


# keyed by the MoE object's identity (MoE defines no __eq__/__hash__), weakly: an entry goes with its object, so a
# dropped model frees its entries and a new object that reuses a freed id never meets a stale one
_PREPARED: "weakref.WeakKeyDictionary[object, _Prepared]" = weakref.WeakKeyDictionary()


def prepare(moe) -> _Prepared:
    """The kernels' view of `moe`, built on its first call and cached for the object's lifetime."""
    p = _PREPARED.get(moe)
    if p is None:
        p = _PREPARED[moe] = _Prepared(moe)
    return p


# ---- references ------------------------------------------------------------------------------------------------


def score(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """The router scores in the logits' dtype: the engine MoE's chain."""
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    raise ValueError(f"unknown scoring_func {scoring_func!r}")


def route_reference(moe, logits: torch.Tensor, input_ids: torch.Tensor):
    """(idx [T, K+1] int32, w [T, K+1] fp32): the engine's routing with ties to the lowest expert index and the
    shared expert appended as column K (index E, weight 1)."""
    p = prepare(moe)
    scores = score(logits, moe.scoring).float()
    T = scores.shape[0]
    if moe.is_hash:
        idx = p.tid2eid[input_ids].long()
    else:
        biased = scores + p.bias if p.bias is not None else scores
        idx = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, : p.K]
    w = scores.gather(1, idx)
    w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * moe.scaling
    shared_idx = torch.full((T, 1), p.E, dtype=torch.long, device=idx.device)
    return (torch.cat([idx, shared_idx], 1).to(torch.int32), torch.cat([w, torch.ones(T, 1, device=w.device)], 1))


def _expert(p: _Prepared, e: int):
    """(gate [I, D], up [I, D], down [D, I]) of expert e; e == E is the shared expert."""
    if e == p.E:
        return p.shared
    return p.gate_up[e, : p.I], p.gate_up[e, p.I :], p.down[e]


def gate_up_reference(moe, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """h [T, K+1, I] (x.dtype) = act(gate.clamp(max=limit)) * up.clamp(-limit, limit) of each pick, fp32 math.
    Every expert runs on every token and a mask keeps the picks: no data-dependent shapes, no host reads."""
    p = prepare(moe)
    xf = x.float()
    h = torch.zeros(*idx.shape, p.I, device=x.device)
    for e in range(p.E + 1):
        g, u, _ = _expert(p, e)
        he = moe.act(F.linear(xf, g.float()).clamp(max=p.limit)) * F.linear(xf, u.float()).clamp(-p.limit, p.limit)
        h = torch.where((idx == e)[..., None], he[:, None, :], h)
    return h.to(x.dtype)


def down_reference(moe, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """y [T, D] = sum_j w[t, j] * W_down[idx[t, j]] @ h[t, j], fp32 accumulation, one rounding."""
    p = prepare(moe)
    hf = h.float()
    y = torch.zeros(h.shape[0], p.D, device=h.device)
    for e in range(p.E + 1):
        _, _, d = _expert(p, e)
        y = y + ((idx == e).float() * w)[..., None].mul(F.linear(hf, d.float())).sum(1)
    return y.to(out_dtype or h.dtype)


def moe_forward_reference(moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    idx, w = route_reference(moe, F.linear(x, moe.router), input_ids)
    return down_reference(moe, gate_up_reference(moe, x, idx), idx, w, x.dtype)


# ---- Triton launches -------------------------------------------------------------------------------------------

# GEMV reduction block: 1024 measured best at T=1 in the integrated H200 run of benchmarks/kernels/step_moe_gpu.py
# (E8 top-2:
# 52.1 vs 55.7 us at 512; E16 top-6: 100.6 vs 113.9 us), for gate_up and down alike
GEMV_BLOCK_K = 1024


def _pick_block_n(rows: int, n: int) -> int:
    """GEMV channel block: 16 while that still gives ~2 programs per SM, else 8. Measured on the H200 (hidden
    4096, I 2048, bf16): gate_up at 3 and 7 picks is fastest with 16 (32: -15% at 7 picks), down at T=1 with 8."""
    return 16 if rows * triton.cdiv(n, 16) >= TARGET_PROGRAMS else 8


def route(moe, logits: torch.Tensor, input_ids: torch.Tensor, *, backend: str = "auto"):
    """(idx [T, K+1] int32, w [T, K+1] fp32) from router logits [T, E]; see the module docstring."""
    p = prepare(moe)
    if not use_triton(backend, [logits, input_ids]):
        return route_reference(moe, logits, input_ids)
    T, E = logits.shape
    idx = torch.empty(T, p.K + 1, dtype=torch.int32, device=logits.device)
    w = torch.empty(T, p.K + 1, dtype=torch.float32, device=logits.device)
    if T == 0:
        return idx, w
    jit(_route_kernel)[(T,)](
        logits.contiguous(),
        p.bias if p.bias is not None else w,
        input_ids.contiguous(),
        p.tid2eid if p.tid2eid is not None else idx,
        idx,
        w,
        E,
        float(moe.scaling),
        K=p.K,
        SCORING=SCORING[moe.scoring],
        HAS_BIAS=p.bias is not None,
        IS_HASH=bool(moe.is_hash),
        ROUND=logits.dtype != torch.float32,
        BLOCK_E=triton.next_power_of_2(E),
        K_PAD=triton.next_power_of_2(p.K),
        num_warps=1,
    )
    return idx, w


# From how many tokens the expert-major tl.dot kernels take over from the GEMVs. H200, E 8 top-2 / E 16 top-6:
# at T=1 the GEMVs win (gate_up by ~5%, down by ~35%); at T=6 the tl.dot kernels win (gate_up 2x, down 1.2x) and at
# T=32 by 3-7x (the GEMVs stream a weight slice per pick). T 2..5 are unmeasured: gate_up switches as soon as two
# tokens can share an expert, down (whose tl.dot grid has fewer programs) later.
MM_MIN_TOKENS = {"gate_up": 2, "down": 4}


# From how many tokens down's "auto" takes the expert-major "rows" kernel instead of "mm" (None: never). Measured at
# 64 rows only (H100, E 8 top-2, hidden 4096, I 2048, bf16; benchmarks/kernels/step_moe_gpu.py, log in
# gpu_results/2026-12-06/moe-rows-attention/): "rows" at MM_LARGE["down_rows"]'s shape 57.7 us per layer against
# 97.2 for "mm" at MM_LARGE["down"]'s. Compiled for sm_90a without a GPU (Triton 3.9, ptxas 13.4), both run one
# 8-warp program per SM: "mm" at 255 registers per thread (a token block's running sums) and 48 KB of shared memory
# (two stages of 64 x 128 weight tiles), "rows" at 180 and 144 KB (three stages of 128 x 128 tiles).
DOWN_ROWS_FROM: int | None = 64


def _mode(mode: str, kernel: str, tokens: int) -> str:
    modes = ("auto", "gemv", "mm", "rows") if kernel == "down" else ("auto", "gemv", "mm")
    if mode not in modes:
        raise ValueError(f"mode must be {', '.join(modes[:-1])} or {modes[-1]}, got {mode!r}")
    if mode != "auto":
        return mode
    if tokens < MM_MIN_TOKENS[kernel]:
        return "gemv"
    rows = kernel == "down" and DOWN_ROWS_FROM is not None and tokens >= DOWN_ROWS_FROM
    return "rows" if rows else "mm"


# Expert-major tl.dot launch shapes for the larger graph buckets (from this row count up): one token block of up to
# 64 rows reads each picked expert once instead of twice, and 64-row dot tiles keep the kernel bandwidth-bound; `down`
# splits its experts into `expert_groups` (capped at E + 1 for models with fewer experts); `down_rows` is down's
# "rows" kernel (one program per expert and 128 channels, so 9 x 32 programs at E 8 + 1). gate_up's and down_rows'
# shapes may also set num_stages and maxnreg (registers per thread). Below these row counts
# (decode and verify at small batch) the smaller shapes above stay. The sweeps that chose them:
# benchmarks/kernels/step_moe_gpu.py, figures in benchmarks/README.md; gate_up's block_k 128 (against 64) from the C64
# decode step with each shape on an H100 (benchmarks/gpu_results/2026-12-07/moe-shapes-h100/: 2,474 against 2,505 us),
# and its 4 stages (against 3) from the same A/B a call later (moe-stages-h100/: median replay 2,426 against 2,439 us).
MM_LARGE = {
    "gate_up": (32, dict(block_t=64, block_m=64, block_n=64, block_k=128, num_warps=8, num_stages=4)),
    "down": (32, dict(block_t=64, block_m=32, block_n=64, block_k=128, num_warps=8, expert_groups=9)),
    "down_rows": (64, dict(block_t=64, block_m=64, block_n=128, block_k=128, num_warps=8)),
}

# --deterministic: one launch shape at every T. Down runs "rows" at the default's 64-row shape (a pick's row does
# not depend on the picks beside it in its tile, and split_sum adds a token's rows in pick order; H200, C64 decode
# step 2.438 ms against the default's 2.214, gpu_results/2026-12-06/deterministic-rows-h200). "mm" stays
# selectable: the same sweep timed its invariant shape at G = 1, 3, 9 and G = 1 won at every T (E 8 top-2 T=1 36.5 /
# 40.5 / 42.8 us, T=64 105.5 / 112.6 / 118.4 us).
MM_INVARIANT = {
    "gate_up": MM_LARGE["gate_up"][1],
    "down": dict(block_t=64, block_m=32, block_n=32, block_k=128, num_warps=8, expert_groups=1),
    "down_rows": MM_LARGE["down_rows"][1],
}


def _mm_shape(kernel: str, tokens: int, given: dict, invariant: bool = False) -> dict:
    """The tl.dot launch keywords at `tokens` rows: MM_LARGE's from its row count on, overridden by what the
    caller set (the sweep's candidates). `invariant`: MM_INVARIANT's at every T, overridden by the caller's keys,
    which the caller keeps the same at every T (the engine sets none)."""
    start, shape = MM_LARGE[kernel]
    base = dict(MM_INVARIANT[kernel]) if invariant else dict(shape) if tokens >= start else {}
    return {**base, **{k: v for k, v in given.items() if v is not None}}


def _token_block(cfg: dict, tokens: int, default: int, invariant: bool) -> int:
    """Tokens per tl.dot program: the shape's, shrunk to T's power of two unless `invariant` (one launch shape)."""
    bt = cfg.get("block_t", default)
    return bt if invariant else min(bt, max(1, triton.next_power_of_2(tokens)))


def _expert_major_launch(cfg: dict, T: int, KP1: int, reduction: int, invariant: bool) -> dict:
    """The launch keywords both expert-major kernels (gate_up's "mm", down's "rows") take from a launch shape `cfg`:
    token block (`_token_block`) and its pick slots, dot tile (block_m 16, block_n 32, block_k 128 capped at the
    reduction's power of two, unless `cfg` sets them), the interpreter's row-wise dots when `invariant`, warps."""
    bt = _token_block(cfg, T, 32, invariant)
    return dict(
        BLOCK_T=bt,
        R_PAD=triton.next_power_of_2(bt * KP1),
        BLOCK_M=max(16, cfg.get("block_m", 16)),
        BLOCK_N=max(16, cfg.get("block_n", 32)),
        BLOCK_K=max(16, min(cfg.get("block_k", 128), triton.next_power_of_2(reduction))),
        ROWWISE=invariant and interpret_mode(),
        num_warps=cfg.get("num_warps", 4),
    )


def _gate_up_tensors(p, x, idx, h) -> tuple:
    """The tensors both gate_up kernels take first, in their parameter order: x, the picks, the routed experts'
    gate_up weights, the shared expert's gate and up weights, and the output h."""
    sg, su, _ = p.shared
    return (x, idx, p.gate_up, sg, su, h)


def _down_tensors(p, h, idx, w, y) -> tuple:
    """The tensors every down kernel takes first, in their parameter order: h, the picks, their routing weights, the
    routed experts' and the shared expert's down weights, and the output y ("rows": the fp32 rows per pick)."""
    return (h, idx, w, p.down, p.shared[2], y)


def _sizes(p, KP1: int) -> dict:
    """The constexpr sizes every gate_up and down kernel takes: hidden D, expert intermediate I, picks per token."""
    return dict(D=p.D, I=p.I, KP1=KP1)


def gate_up(
    moe,
    x: torch.Tensor,
    idx: torch.Tensor,
    *,
    backend: str = "auto",
    mode: str = "auto",
    block_n: int | None = None,
    block_k: int | None = None,
    block_t: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """h [T, K+1, I] (x.dtype) for picks idx [T, K+1] (index E = shared expert). mode "gemv": one program per
    (pick, channel block), weights streamed as coalesced rows (few picks); "mm": expert-major tl.dot over
    compacted picks per token block of `block_t` tokens (many picks); "auto" picks by T (MM_MIN_TOKENS).
    `invariant` (--deterministic): "mm" with MM_INVARIANT's launch shape at every T."""
    p = prepare(moe)
    if not use_triton(backend, [x, idx]):
        return gate_up_reference(moe, x, idx)
    T, KP1 = idx.shape
    h = torch.empty(T, KP1, p.I, device=x.device, dtype=x.dtype)
    if T * KP1 == 0:
        return h
    extra = {} if num_stages is None else {"num_stages": num_stages}
    x, idx = x.contiguous(), idx.contiguous()
    if _mode("mm" if invariant else mode, "gate_up", T) == "gemv":
        _gate_up_gemv(p, x, idx, h, block_n, block_k, num_warps, extra)
    else:
        given = dict(block_t=block_t, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps)
        _gate_up_mm(p, x, idx, h, _mm_shape("gate_up", T, given, invariant), invariant, extra)
    return h


def _gate_up_gemv(p, x, idx, h, block_n, block_k, num_warps, extra: dict) -> None:
    """gate_up's "gemv" mode into h: one program per (pick, channel block)."""
    T, KP1 = idx.shape
    R = T * KP1
    bn = block_n or _pick_block_n(R, p.I)
    bk = min(block_k or GEMV_BLOCK_K, triton.next_power_of_2(p.D))
    jit(_gate_up_kernel, ("R",))[(R * triton.cdiv(p.I, bn),)](
        *_gate_up_tensors(p, x, idx, h),
        R,
        p.E,
        p.limit,
        **_sizes(p, KP1),
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=num_warps or 4,
        **extra,
    )


def _gate_up_mm(p, x, idx, h, cfg: dict, invariant: bool, extra: dict) -> None:
    """gate_up's "mm" mode into h: expert-major tl.dot over token blocks, launch shape `cfg` (`_mm_shape`)."""
    T, KP1 = idx.shape
    launch = _expert_major_launch(cfg, T, KP1, p.D, invariant)
    grid = (p.E + 1, triton.cdiv(p.I, launch["BLOCK_N"]), triton.cdiv(T, launch["BLOCK_T"]))
    jit(_gate_up_mm_kernel, ("T",), helpers=(tile_dot, _pick_slots))[grid](
        *_gate_up_tensors(p, x, idx, h),
        T,
        p.E,
        p.limit,
        **_sizes(p, KP1),
        **launch,
        IEEE=p.gate_up.dtype == torch.float32,
        **_compiler_options(cfg, extra),
    )


def _compiler_options(cfg: dict, extra: dict) -> dict:
    """An expert-major launch's num_stages and maxnreg: the launch shape's (MM_LARGE may set them), the caller's
    num_stages (`extra`) over it."""
    return {**{k: cfg[k] for k in ("num_stages", "maxnreg") if cfg.get(k)}, **extra}


def down(
    moe,
    h: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    *,
    out_dtype=None,
    backend: str = "auto",
    mode: str = "auto",
    block_n: int | None = None,
    block_k: int | None = None,
    block_t: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    expert_groups: int | None = None,
    maxnreg: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """y [T, D] = sum over the K+1 picks of w * W_down[idx] @ h, fp32 accumulation, one rounding. Modes as in
    `gate_up` ("mm": programs over (channel block, token block) walk the experts), plus "rows": expert-major
    programs like gate_up's "mm" write one fp32 row per pick, and a second launch sums each token's rows in pick
    order (`_down_rows`); "auto" takes it from DOWN_ROWS_FROM rows on (None: never), with MM_LARGE["down_rows"]'s
    shape. `maxnreg` ("rows" only) caps the registers per thread, so that more programs share an SM.
    `invariant` (--deterministic): "rows" (or "mm" when asked for) with MM_INVARIANT's launch shape at every T;
    mode "gemv" is refused.

    `expert_groups` G ("mm" only; default 1, MM_LARGE's from its row count on, capped at E + 1) is for
    parallelism: with G = 1 a program walks all E + 1 experts one after the other (a data-dependent `if cnt > 0`
    per expert between their loads), and a 64-row batch in one token block makes only D / block_n programs (128 at
    hidden 4096 and block_n 32, against 132 H200 SMs), each streaming every picked expert's slice. G > 1 adds a grid
    axis over G contiguous groups of experts (G times the programs, each walking about (E + 1) / G experts); the
    groups' fp32 sums go to a [G, T, D] float32 buffer and one `batch_invariant.split_sum` launch adds them in
    group order and rounds once into y (G x T x D x 8 bytes of extra traffic). Same contract as G = 1; the fp32
    adds are grouped differently, so bits may differ from G = 1 but not with the batch: G is part of the launch
    shape, which `invariant` fixes."""
    p = prepare(moe)
    if not use_triton(backend, [h, idx, w]):
        return down_reference(moe, h, idx, w, out_dtype)
    T, KP1 = idx.shape
    y = torch.empty(T, p.D, device=h.device, dtype=out_dtype or h.dtype)
    if T == 0:
        return y
    extra = {} if num_stages is None else {"num_stages": num_stages}
    h, idx, w = h.contiguous(), idx.contiguous(), w.contiguous()
    if invariant and mode == "gemv":
        raise ValueError("invariant: down's mode is 'rows' or 'mm', whose launch shape is the same at every T")
    chosen = _mode(("rows" if mode == "auto" else mode) if invariant else mode, "down", T)
    if chosen == "gemv":
        _down_gemv(p, h, idx, w, y, block_n, block_k, num_warps, extra)
        return y
    if maxnreg is not None and chosen != "rows":
        raise ValueError("maxnreg is for down's mode 'rows'")
    if chosen == "rows":
        if expert_groups is not None:
            raise ValueError("expert_groups is for down's mode 'mm'; mode 'rows' sums each token's picks instead")
        given = dict(
            block_t=block_t, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, maxnreg=maxnreg
        )
        _down_rows(p, h, idx, w, y, _mm_shape("down_rows", T, given, invariant), invariant, extra)
        return y
    given = dict(
        block_t=block_t,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        num_warps=num_warps,
        expert_groups=expert_groups,
    )
    cfg = _mm_shape("down", T, given, invariant)
    groups = _expert_groups(cfg, expert_groups, p.E)
    _down_mm(p, h, idx, w, y, cfg, groups, invariant, extra)
    return y


def _down_gemv(p, h, idx, w, y, block_n, block_k, num_warps, extra: dict) -> None:
    """down's "gemv" mode into y: one program per (token, channel block)."""
    T, KP1 = idx.shape
    bn = block_n or _pick_block_n(T, p.D)
    bk = min(block_k or GEMV_BLOCK_K, triton.next_power_of_2(p.I))
    jit(_down_kernel, ("T",))[(T * triton.cdiv(p.D, bn),)](
        *_down_tensors(p, h, idx, w, y),
        T,
        p.E,
        **_sizes(p, KP1),
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=num_warps or 4,
        **extra,
    )


def _down_rows(p, h, idx, w, y, cfg: dict, invariant: bool, extra: dict) -> None:
    """down's "rows" mode into y: expert-major tl.dot kernels write one fp32 row per pick (part [T * (K+1), D]:
    (K+1) x T x D x 8 bytes of extra traffic, 6 MB at T 64 and hidden 4096, against 151 MB of E 8 + 1 experts'
    down weights), then one `split_sum` launch adds each token's K+1 rows in pick order and rounds once into y."""
    T, KP1 = idx.shape
    launch = _expert_major_launch(cfg, T, KP1, p.I, invariant)
    part = torch.empty(T * KP1, p.D, device=y.device, dtype=torch.float32)
    grid = (p.E + 1, triton.cdiv(p.D, launch["BLOCK_N"]), triton.cdiv(T, launch["BLOCK_T"]))
    jit(_down_rows_kernel, ("T",), helpers=(tile_dot, _pick_slots, _down_tile))[grid](
        *_down_tensors(p, h, idx, w, part),
        T,
        p.E,
        **_sizes(p, KP1),
        **launch,
        IEEE=p.down.dtype == torch.float32,
        **_compiler_options(cfg, extra),
    )
    split_sum(part.view(T, KP1, 1, p.D), None, y.view(T, 1, p.D), backend="triton")


def _expert_groups(cfg: dict, given: int | None, E: int) -> int:
    """down's G: the launch shape's, capped at E + 1 when the caller gave none; ValueError outside 1..E + 1."""
    groups = cfg.get("expert_groups", 1)
    if given is None and isinstance(groups, int):  # the table's G, for models with fewer experts
        groups = min(groups, E + 1)
    if not (isinstance(groups, int) and 1 <= groups <= E + 1):
        raise ValueError(f"expert_groups must be an integer in 1..{E + 1} (E + 1 experts), got {groups!r}")
    return groups


def _down_mm(p, h, idx, w, y, cfg: dict, groups: int, invariant: bool, extra: dict) -> None:
    """down's "mm" mode into y: programs over (channel block, token block, expert group) walk the experts; G > 1
    sums the groups' fp32 parts into y in group order."""
    T, KP1 = idx.shape
    bt = max(16, _token_block(cfg, T, 32, invariant))
    bn = max(16, cfg.get("block_n", 16))
    # each program walks every expert serially, so fewer, longer k steps pay below MM_LARGE (H200, E 8 T=32: bn 32/bk
    # 64 113 us, bn 16/bk 128 81 us, bk 256 67.6 us)
    bk = max(16, min(cfg.get("block_k", 256), triton.next_power_of_2(p.I)))
    parts = y if groups == 1 else torch.empty(groups, T, p.D, device=y.device, dtype=torch.float32)
    jit(_down_mm_kernel, ("T",), helpers=(tile_dot, _pick_slots, _down_tile))[
        (triton.cdiv(p.D, bn), triton.cdiv(T, bt), groups)
    ](
        *_down_tensors(p, h, idx, w, y),
        parts,
        T,
        p.E,
        **_sizes(p, KP1),
        BLOCK_T=bt,
        R_PAD=triton.next_power_of_2(bt * KP1),
        BLOCK_M=max(16, cfg.get("block_m", 16)),
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUPS=groups,
        IEEE=p.down.dtype == torch.float32,
        ROWWISE=invariant and interpret_mode(),
        num_warps=cfg.get("num_warps", 4),
        **extra,
    )
    if groups > 1:
        split_sum(parts.unsqueeze(0), None, y.unsqueeze(0), backend="triton")


def moe_forward(
    moe,
    x: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    backend: str = "auto",
    gate_up_cfg: dict | None = None,
    down_cfg: dict | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """y [T, hidden] (x.dtype) = engine `MoE.__call__(x, input_ids)`: routed top-k (or hash) experts plus the
    shared expert, in 4 launches on the Triton path (router GEMM, route, gate_up, down; 5 when down splits its
    experts into groups or runs "rows"). `gate_up_cfg` / `down_cfg` override the kernels' choices for tuning (mode
    "gemv"/"mm", down's "rows", block_n, block_k, block_t, block_m, num_warps, num_stages, and down's
    expert_groups and maxnreg; see `gate_up` / `down`). `invariant` (--deterministic): one path and one launch
    shape at every T (the router GEMM is batch-invariant under kernels.batch_invariant.invariant_ops)."""
    p = prepare(moe)
    if not p.kernel_ok or not use_triton(backend, [x, input_ids, p.gate_up]):
        if backend == "triton" and not p.kernel_ok:
            raise ValueError(
                "backend='triton': this MoE (activation, scoring, shared-expert shape or dtypes) "
                "has no kernel; use backend='auto'"
            )
        return moe_forward_reference(moe, x, input_ids)
    idx, w = route(moe, F.linear(x, p.router), input_ids, backend="triton")
    h = gate_up(moe, x, idx, backend="triton", invariant=invariant, **(gate_up_cfg or {}))
    return down(moe, h, idx, w, out_dtype=x.dtype, backend="triton", invariant=invariant, **(down_cfg or {}))
