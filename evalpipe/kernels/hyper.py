"""mHC between blocks in two kernels per block instead of ~5, for the CUDA-graph step; and `sinkhorn`.

Eagerly, each block runs streams.float(), the mixing GEMV, the pre/post/comb maps with the Sinkhorn iterations
(~140 tiny kernels), the collapse, the block's RMSNorm and, after the block, the merge. Here the merge that ends one
block also computes what the next block's hyper-connection needs from the new streams -- each program's partial dot
products of its slice of the flattened streams with the next `fn` plus its partial sum of squares (`hc_merge_mix`,
many programs) -- so the next block starts with one small kernel that reduces those partials in a fixed order, runs
pre/post/comb + Sinkhorn, collapses the streams and applies the block's input RMSNorm (`hc_pre_norm`;
`hc_head_norm` for the model head). No atomics: bitwise deterministic. From DOT_MIN_ROWS rows (prompt chunks) the
merge/mix computes the same partial blocks as GEMM tiles (`tl.dot`, fp32) instead of one reduction per row.

`StaticModel.forward` (engine/static/model.py) is the caller: `hc_mix` on the embedded streams, then per layer
`hc_pre_norm` -> attention -> `hc_merge_mix` (partials for the layer's ffn_hc) -> `hc_pre_norm` -> MoE ->
`hc_merge_mix` (partials for the next layer's attn_hc, or the head), and `hc_head_norm` before the lm_head.

A hyper-connection is passed as the engine's layer object (`HyperConnection`: fn, base, scale, hc, iters, eps,
norm_eps; `HyperHead`: fn, base, scale, eps, norm_eps). Its preparation (contiguous fp32 fn/base/scale, mix count)
is cached in `_PREP` keyed by id(obj) on first use (dropped when the object is collected); nothing is prepared per
step. The partials' blocking depends only on D and T (`mix_block`), so the reference and the Triton kernel produce
comparable partials. `sinkhorn` is the engine's own Sinkhorn projection (engine/model/hyper.py imports it).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn.functional as F

from evalpipe.kernels._backend import jit, use_triton
from evalpipe.kernels.norm import rms_norm_reference

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None

MIX_WARPS = 4  # warps of a per-row merge/mix program (but the decode steps': _mix_warps)
NORM_WARPS = 0  # warps of a pre_norm program; 0: by row size
NORM_SPLIT = True  # pre_norm: Sinkhorn and collapse + norm in two programs per row
MAX_ROW = 65536  # hc * next_pow2(D) elements that one hc_pre_norm program holds; wider rows use the reference


_empty = torch.empty  # every output buffer comes from here (tests swap in a NaN-filled one)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def mix_block(D: int, T: int, invariant: bool = False) -> int:
    """Columns of each stream that one merge/mix program owns: the partials have cdiv(D, mix_block(D, T))
    blocks. Narrow blocks spread few rows over many SMs; with many rows, wide blocks read fn fewer times.
    `invariant` (--deterministic): 128 at every T, so a row's partials, and their sum, do not depend on T."""
    if invariant or T >= DOT_MIN_ROWS:
        return min(128, _pow2(D))
    return min(64 if _decode_shape(T) else 32, _pow2(D))


# From this many rows (prompt chunks, wide verify steps) the merge/mix runs as a GEMM tile. Not below: at 64 rows the
# tiles made the C64 decode step slower on an H200 (2.325 ms with 16-row tiles, 2.446 with 32, against 2.214 for the
# per-row kernel; gpu_results/2026-12-06/deterministic-rows-h200)
DOT_MIN_ROWS = 128
DOT_ROWS, DOT_SUB, DOT_WARPS = 32, 64, 4  # rows and columns of one GEMM tile, warps of its program


# The decode steps of batch DECODE_MIN_ROWS and up (to DOT_MIN_ROWS) take 64 columns, 2 rows and 2 warps a program:
# v4-top2's C64 step replayed 71 us faster than at 128 / 4 / 4 on an H100 (2,364 against 2,435 us;
# gpu_results/2026-12-07/mix-shapes-h100). Below it: 32 columns and MIX_WARPS a program (a row each up to 8 rows).
DECODE_MIN_ROWS = 16


def _decode_shape(T: int) -> bool:
    """Whether a merge/mix of T rows takes the decode steps' launch shape (outside --deterministic)."""
    return DECODE_MIN_ROWS <= T < DOT_MIN_ROWS


def _rows_per_program(T: int) -> int:
    """Rows one merge/mix program handles, reusing its fn slice from registers (fn is read from L2 T / rows
    times). Does not change any result: each row's arithmetic is the same whatever the grouping."""
    return 1 if T <= 8 else 2 if _decode_shape(T) else 4


def _mix_warps(T: int, invariant: bool) -> int:
    """Warps of a per-row merge/mix program. A reduction's order can follow the warp count, so --deterministic
    keeps MIX_WARPS at every T (a row's partials must not depend on T); the decode steps take 2."""
    return 2 if not invariant and _decode_shape(T) else MIX_WARPS


# ---- per-object preparation ------------------------------------------------------------------------------------

_PREP: dict[int, tuple] = {}


def _prep(obj) -> tuple:
    """(obj, fn [M, hc*D] fp32 contiguous, base fp32, scale fp32, M) for a HyperConnection or HyperHead. The entry
    goes when obj is collected (a dropped model frees its weights); objects without weak references are pinned
    by their entry, so their id cannot be reused."""
    key = id(obj)
    if key not in _PREP:
        _PREP[key] = (
            None,
            obj.fn.float().contiguous(),
            obj.base.float().contiguous(),
            obj.scale.float().reshape(-1).contiguous(),
            obj.fn.shape[0],
        )
        try:
            weakref.finalize(obj, _PREP.pop, key, None)
        except TypeError:
            _PREP[key] = (obj,) + _PREP[key][1:]
    return _PREP[key]


# ---- kernel sources (built on first use by `jit`) -------------------------------------------------------------

if tl is not None:

    def _merge_mix_kernel(
        streams_ptr,
        block_ptr,
        post_ptr,
        comb_ptr,
        new_ptr,
        fn_ptr,
        part_ptr,
        T,
        D,
        M: tl.constexpr,
        M_PAD: tl.constexpr,
        MERGE: tl.constexpr,
        HC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        g = tl.program_id(0)
        b = tl.program_id(1)
        nb = tl.num_programs(1)
        K = HC * D
        hs = tl.arange(0, HC)
        ks = b * BLOCK + tl.arange(0, BLOCK)
        km = ks < D
        ms = tl.arange(0, M_PAD)
        col = hs[:, None] * D + ks[None, :]  # [HC, BLOCK] offsets into one flattened row
        # this program's slice of fn [M_PAD, HC, BLOCK], read once and reused for each of its rows
        f = tl.load(
            fn_ptr + ms[:, None, None].to(tl.int64) * K + col[None, :, :],
            mask=(ms[:, None, None] < M) & km[None, None, :],
            other=0.0,
        )
        for i in tl.static_range(ROWS):
            t = g * ROWS + i
            ok = t < T  # (masks are built from comparisons alone: the interpreter rejects bool & scalar bool)
            t64 = t.to(tl.int64)
            kr = ks < tl.where(ok, D, 0)  # this row's live columns (none past the last row)
            hr = hs < tl.where(ok, HC, 0)
            m2 = hr[:, None] & kr[None, :]
            s = tl.load(streams_ptr + t64 * K + col, mask=m2, other=0.0).to(tl.float32)
            if MERGE:  # HyperConnection.merge accumulated in fp32, one rounding
                y = tl.load(block_ptr + t64 * D + ks, mask=kr, other=0.0).to(tl.float32)
                post = tl.load(post_ptr + t64 * HC + hs, mask=hr, other=0.0)
                comb = tl.load(
                    comb_ptr + t64 * HC * HC + hs[:, None] * HC + hs[None, :],
                    mask=hr[:, None] & (hs[None, :] < HC),
                    other=0.0,
                )  # [j, h]
                mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)  # [h, BLOCK]
                out = (post[:, None] * y[None, :] + mixed).to(new_ptr.dtype.element_ty)
                tl.store(new_ptr + t64 * K + col, out, mask=m2)
                s = out.to(tl.float32)  # the next block sees the stored (rounded) streams
            part = tl.sum(tl.sum(f * s[None, :, :], axis=2), axis=1)  # [M_PAD]
            ss = tl.sum(tl.sum(s * s, axis=1), axis=0)
            prow = part_ptr + (t64 * nb + b) * (M + 1)
            tl.store(prow + ms, part, mask=ms < tl.where(ok, M, 0))
            tl.store(prow + M, ss, mask=ok)

    def _merge_mix_dot_kernel(
        streams_ptr,
        block_ptr,
        post_ptr,
        comb_ptr,
        new_ptr,
        fn_ptr,
        part_ptr,
        T,
        D,
        M: tl.constexpr,
        M_DOT: tl.constexpr,
        MERGE: tl.constexpr,
        HC: tl.constexpr,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
        SUB: tl.constexpr,
    ):
        # the same partials as _merge_mix_kernel for ROWS rows at once: per stream h and SUB columns, the rows'
        # slice [ROWS, SUB] times fn's [SUB, M_DOT] on tl.dot (fp32, ieee), accumulated in registers, instead of
        # a cross-thread reduction per row (which left the per-row kernel at ~10x its byte time on prompt chunks)
        g = tl.program_id(0)
        b = tl.program_id(1)
        nb = tl.num_programs(1)
        K = HC * D
        ts = g * ROWS + tl.arange(0, ROWS)
        tm = ts < T
        t64 = ts.to(tl.int64)
        ms = tl.arange(0, M_DOT)
        part = tl.zeros([ROWS, M_DOT], dtype=tl.float32)
        ss = tl.zeros([ROWS], dtype=tl.float32)
        for sub in tl.static_range(BLOCK // SUB):
            ks = b * BLOCK + sub * SUB + tl.arange(0, SUB)
            km = ks < D
            m2 = tm[:, None] & km[None, :]
            if MERGE:
                y = tl.load(block_ptr + t64[:, None] * D + ks[None, :], mask=m2, other=0.0).to(tl.float32)
            for h in tl.static_range(HC):
                if MERGE:  # HyperConnection.merge accumulated in fp32, one rounding
                    mixed = tl.zeros([ROWS, SUB], dtype=tl.float32)
                    for j in tl.static_range(HC):
                        sj = tl.load(streams_ptr + t64[:, None] * K + j * D + ks[None, :], mask=m2, other=0.0).to(
                            tl.float32
                        )
                        c = tl.load(comb_ptr + t64 * HC * HC + j * HC + h, mask=tm, other=0.0)
                        mixed += c[:, None] * sj
                    post = tl.load(post_ptr + t64 * HC + h, mask=tm, other=0.0)
                    out = (post[:, None] * y + mixed).to(new_ptr.dtype.element_ty)
                    tl.store(new_ptr + t64[:, None] * K + h * D + ks[None, :], out, mask=m2)
                    s = out.to(tl.float32)  # the next block sees the stored (rounded) streams
                else:
                    s = tl.load(streams_ptr + t64[:, None] * K + h * D + ks[None, :], mask=m2, other=0.0).to(tl.float32)
                f = tl.load(
                    fn_ptr + ms[None, :].to(tl.int64) * K + h * D + ks[:, None],
                    mask=km[:, None] & (ms[None, :] < M),
                    other=0.0,
                )  # [SUB, M_DOT]
                part += tl.dot(s, f, input_precision="ieee")
                ss += tl.sum(s * s, axis=1)
        prow = part_ptr + (t64 * nb + b) * (M + 1)
        tl.store(prow[:, None] + ms[None, :], part, mask=tm[:, None] & (ms[None, :] < M))
        tl.store(prow + M, ss, mask=tm)

    def _pre_norm_kernel(
        streams_ptr,
        part_ptr,
        base_ptr,
        scale_ptr,
        normw_ptr,
        post_ptr,
        comb_ptr,
        out_ptr,
        D,
        NB,
        norm_eps,
        eps,
        rms_eps,
        HEAD: tl.constexpr,
        M: tl.constexpr,
        HC: tl.constexpr,
        ITERS: tl.constexpr,
        COMB_ROLE: tl.constexpr,
        NB_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # program (t, 0) collapses + normalises; program (t, COMB_ROLE) works out post / comb (the serial
        # Sinkhorn): with COMB_ROLE 1 that is a second program, on another SM at the same time
        t = tl.program_id(0).to(tl.int64)
        role = tl.program_id(1)
        hs = tl.arange(0, HC)
        ds = tl.arange(0, BLOCK_D)
        dm = ds < tl.where(role == 0, D, 0)
        # the row's streams first (role 0 only), so their loads are in flight while the mixes are worked out
        s = tl.load(streams_ptr + t * HC * D + hs[:, None] * D + ds[None, :], mask=dm[None, :], other=0.0).to(
            tl.float32
        )
        bs = tl.arange(0, NB_PAD)
        bm = bs < NB
        prow = part_ptr + (t * NB + bs) * (M + 1)  # [NB_PAD]: each column is summed over the blocks in one tree
        ss = tl.sum(tl.load(prow + M, mask=bm, other=0.0), axis=0)
        r = 1.0 / tl.sqrt(ss / (HC * D) + norm_eps)
        if role == COMB_ROLE:  # (-1 for the head: no post / comb)
            post_raw = tl.sum(tl.load(prow[:, None] + HC + hs[None, :], mask=bm[:, None], other=0.0), axis=0)
            post = 2.0 * tl.sigmoid(post_raw * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + hs))
            cidx = 2 * HC + hs[:, None] * HC + hs[None, :]
            c_raw = tl.sum(tl.load(prow[:, None, None] + cidx[None, :, :], mask=bm[:, None, None], other=0.0), axis=0)
            c = c_raw * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx)
            c = tl.exp(c - tl.max(c, axis=1)[:, None])
            c = c / tl.sum(c, axis=1)[:, None] + eps
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
            for _ in tl.static_range(ITERS - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + eps)
                c = c / (tl.sum(c, axis=0)[None, :] + eps)
            tl.store(post_ptr + t * HC + hs, post)
            tl.store(comb_ptr + t * HC * HC + hs[:, None] * HC + hs[None, :], c)
        if role == 0:
            dt = out_ptr.dtype.element_ty
            pre_raw = tl.sum(tl.load(prow[:, None] + hs[None, :], mask=bm[:, None], other=0.0), axis=0)
            pre = tl.sigmoid(pre_raw * r * tl.load(scale_ptr) + tl.load(base_ptr + hs)) + eps
            # collapse, rounded to the streams' dtype, then the block's RMSNorm (rms_norm_reference's roundings)
            x = tl.sum(pre[:, None] * s, axis=0).to(dt).to(tl.float32)
            rr = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + rms_eps)
            y = tl.load(normw_ptr + ds, mask=dm, other=0.0) * (x * rr)
            tl.store(out_ptr + t * D + ds, y.to(dt), mask=dm)


# ---- references ------------------------------------------------------------------------------------------------


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Alternate column / row normalisation of [T, hc, hc] (column first, `iters` column passes in all).

    On CPU the ~60 tiny sequential ops run in numpy, where one op costs ~1 us instead of ~5 us through torch; with
    many rows the matrices are laid out hc-major so each sum is a few contiguous adds over T. Both numpy layouts
    add the hc terms in the same sequential order, so results do not depend on the batch size."""
    if comb.device.type == "cpu" and comb.dtype == torch.float32 and comb.shape[-1] >= 2:
        e = np.float32(eps)
        if comb.shape[0] < 8:
            add, div = np.add.reduce, np.divide  # the ufuncs themselves: no Python wrapper per call
            a = comb.numpy()
            a = a / (add(a, axis=-2, keepdims=True) + e)
            for _ in range(iters - 1):
                div(a, add(a, axis=-1, keepdims=True) + e, out=a)
                div(a, add(a, axis=-2, keepdims=True) + e, out=a)
            return torch.from_numpy(a)
        b = np.ascontiguousarray(comb.numpy().transpose(1, 2, 0))  # [hc_in, hc_out, T]
        hc = b.shape[0]
        rows = [b[i] for i in range(hc)]  # views [hc_out, T]
        cols = [b[:, j] for j in range(hc)]  # views [hc_in, T]

        def col_pass():  # divide by the sum over hc_in (axis -2 of the [T, hc, hc] matrix)
            acc = rows[0] + rows[1]
            for r in rows[2:]:
                acc += r
            acc += e
            b.__itruediv__(acc)

        def row_pass():  # divide by the sum over hc_out (axis -1)
            acc = cols[0] + cols[1]
            for c in cols[2:]:
                acc += c
            acc += e
            b.__itruediv__(acc[:, None, :])

        col_pass()
        for _ in range(iters - 1):
            row_pass()
            col_pass()
        return torch.from_numpy(b.transpose(2, 0, 1))
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mix_reference(streams: torch.Tensor, fn: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """partials [T, nb, M + 1] fp32: per block of `block` columns of every stream, the dot products of the
    flattened fp32 streams with fn [M, hc * D] and (last) the sum of squares."""
    T, hc, D = streams.shape
    block = block or mix_block(D, T)
    nb, M = _cdiv(D, block), fn.shape[0]
    pad = nb * block - D
    s = F.pad(streams.float(), (0, pad)).view(T, hc, nb, block)
    f = F.pad(fn.float().view(M, hc, D), (0, pad)).view(M, hc, nb, block)
    dots = torch.einsum("thbk,mhbk->tbm", s, f)
    return torch.cat([dots, s.square().sum(dim=(1, 3)).unsqueeze(-1)], dim=-1)


def hc_merge_mix_reference(streams, block_out, post, comb, fn, block: int | None = None):
    """HyperConnection.merge's new streams (fp32 accumulate, one rounding) and their partials for fn."""
    new = (
        post.unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams.float())
    ).to(streams.dtype)
    return new, hc_mix_reference(new, fn, block)


def _scaled_mixes(streams, partials, M: int, norm_eps: float) -> torch.Tensor:
    sums = partials.sum(dim=1)
    r = torch.rsqrt(sums[:, M : M + 1] / (streams.shape[1] * streams.shape[2]) + norm_eps)
    return sums[:, :M] * r


def hc_pre_norm_reference(
    streams, partials, base, scale, norm_w, rms_eps, *, hc: int, iters: int, eps: float, norm_eps: float
):
    """HyperConnection.__call__ (from the partials' mixes and sum of squares) followed by rms_norm_reference."""
    mixes = _scaled_mixes(streams, partials, 2 * hc + hc * hc, norm_eps)
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.reshape(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = sinkhorn(comb.contiguous(), iters, eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, rms_norm_reference(collapsed, norm_w, rms_eps)


def hc_head_norm_reference(streams, partials, base, scale, norm_w, rms_eps, *, eps: float, norm_eps: float):
    """HyperHead.__call__ (from the partials) followed by rms_norm_reference."""
    mixes = _scaled_mixes(streams, partials, streams.shape[1], norm_eps)
    pre = torch.sigmoid(mixes * scale + base) + eps
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return rms_norm_reference(collapsed, norm_w, rms_eps)


# ---- dispatchers -----------------------------------------------------------------------------------------------


def _launch_mix(streams, block_out, post, comb, fn, M: int, new, invariant: bool) -> torch.Tensor:
    T, hc, D = streams.shape
    block = mix_block(D, T, invariant)
    nb = _cdiv(D, block)
    parts = _empty(T, nb, M + 1, device=streams.device, dtype=torch.float32)
    merge = block_out is not None
    args = (
        streams,
        block_out if merge else streams,
        post if merge else fn,
        comb if merge else fn,
        new if merge else streams,
        fn,
        parts,
        T,
        D,
    )
    if T >= DOT_MIN_ROWS and block % DOT_SUB == 0 and not invariant:  # invariant: the per-row kernel at every T
        jit(_merge_mix_dot_kernel, ("T",))[(_cdiv(T, DOT_ROWS), nb)](
            *args,
            M=M,
            M_DOT=max(16, _pow2(M)),
            MERGE=merge,
            HC=hc,
            ROWS=DOT_ROWS,
            BLOCK=block,
            SUB=DOT_SUB,
            num_warps=DOT_WARPS,
        )
    elif T:
        rows = _rows_per_program(T)
        jit(_merge_mix_kernel, ("T",))[(_cdiv(T, rows), nb)](
            *args,
            M=M,
            M_PAD=_pow2(M),
            MERGE=merge,
            HC=hc,
            ROWS=rows,
            BLOCK=block,
            num_warps=_mix_warps(T, invariant),
        )
    return parts


def hc_mix(streams: torch.Tensor, hc, *, backend: str = "auto", invariant: bool = False) -> torch.Tensor:
    """Partials [T, nb, M + 1] of streams [T, hc, D] for `hc` (a HyperConnection or the HyperHead): the first
    block's input, which no merge produced. `invariant`: `mix_block`'s and one kernel path at every T."""
    _, fn, _, _, M = _prep(hc)
    if not use_triton(backend, [streams, fn]):
        return hc_mix_reference(streams, fn, mix_block(streams.shape[2], streams.shape[0], invariant))
    return _launch_mix(streams.contiguous(), None, None, None, fn, M, None, invariant)


def hc_merge_mix(streams, block_out, post, comb, next_hc, *, backend: str = "auto", invariant: bool = False):
    """(new streams [T, hc, D] in streams' dtype, their partials [T, nb, M + 1] fp32 for `next_hc`): the merge
    after a block (HyperConnection.merge, fp32 accumulation) and the next hyper-connection's mixing GEMV in one
    kernel. `invariant` as in `hc_mix`."""
    _, fn, _, _, M = _prep(next_hc)
    if not use_triton(backend, [streams, block_out, post, comb, fn]):
        block = mix_block(streams.shape[2], streams.shape[0], invariant)
        return hc_merge_mix_reference(streams, block_out, post, comb, fn, block)
    streams = streams.contiguous()
    new = _empty(streams.shape, device=streams.device, dtype=streams.dtype)
    parts = _launch_mix(streams, block_out.contiguous(), post.contiguous(), comb.contiguous(), fn, M, new, invariant)
    return new, parts


def _launch_norm(streams, partials, base, scale, norm_w, rms_eps, obj, head: bool, M: int):
    T, hc, D = streams.shape
    out = _empty(T, D, device=streams.device, dtype=streams.dtype)
    post = _empty(T, hc, device=streams.device, dtype=torch.float32)
    comb = _empty(T, hc, hc, device=streams.device, dtype=torch.float32)
    if T:
        block_d = _pow2(D)
        split = NORM_SPLIT and not head
        jit(_pre_norm_kernel)[(T, 2 if split else 1)](
            streams,
            partials,
            base,
            scale,
            norm_w,
            post,
            comb,
            out,
            D,
            partials.shape[1],
            float(obj.norm_eps),
            float(obj.eps),
            float(rms_eps),
            HEAD=head,
            M=M,
            HC=hc,
            ITERS=1 if head else int(obj.iters),
            COMB_ROLE=-1 if head else int(split),
            NB_PAD=_pow2(partials.shape[1]),
            BLOCK_D=block_d,
            num_warps=NORM_WARPS or (8 if hc * block_d >= 8192 else 4),
        )
    return post, comb, out


def _check(streams, partials, M: int, invariant: bool):
    T, hc, D = streams.shape
    if partials.shape != (T, _cdiv(D, mix_block(D, T, invariant)), M + 1):
        raise ValueError(f"partials {tuple(partials.shape)} do not fit streams {tuple(streams.shape)} and {M} mixes")


def hc_pre_norm(streams, partials, hc, norm_w, eps: float, *, backend: str = "auto", invariant: bool = False):
    """(post [T, hc] fp32, comb [T, hc, hc] fp32, x [T, D]) = HyperConnection `hc` applied to streams, its
    collapsed input then RMSNormed with gain norm_w and `eps` -- in one kernel, from the partials hc_mix /
    hc_merge_mix wrote for `hc` (with the same `invariant`)."""
    _, _, base, scale, M = _prep(hc)
    _check(streams, partials, M, invariant)
    n = streams.shape[1]
    if M != 2 * n + n * n:
        raise ValueError(f"{M} mixes is not a hyper-connection of {n} streams")
    if not use_triton(backend, [streams, partials, base, norm_w]) or n * _pow2(streams.shape[2]) > MAX_ROW:
        return hc_pre_norm_reference(
            streams, partials, base, scale, norm_w, eps, hc=n, iters=hc.iters, eps=hc.eps, norm_eps=hc.norm_eps
        )
    return _launch_norm(streams.contiguous(), partials.contiguous(), base, scale, norm_w, eps, hc, False, M)


def hc_head_norm(
    streams, partials, head, norm_w, eps: float, *, backend: str = "auto", invariant: bool = False
) -> torch.Tensor:
    """x [T, D] = rms_norm(HyperHead `head`(streams), norm_w, eps) in one kernel, from hc_merge_mix's partials for
    the head (with the same `invariant`)."""
    _, _, base, scale, M = _prep(head)
    _check(streams, partials, M, invariant)
    if M != streams.shape[1]:
        raise ValueError(f"{M} mixes is not a head of {streams.shape[1]} streams")
    if not use_triton(backend, [streams, partials, base, norm_w]) or M * _pow2(streams.shape[2]) > MAX_ROW:
        return hc_head_norm_reference(streams, partials, base, scale, norm_w, eps, eps=head.eps, norm_eps=head.norm_eps)
    return _launch_norm(streams.contiguous(), partials.contiguous(), base, scale, norm_w, eps, head, True, M)[2]
