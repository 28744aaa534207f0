"""The compressor windows of the CUDA-graph step (every compressor but the fused ratio-2 one) in one kernel.

The eager `Compressor.pool` (engine/model/compressor.py) skips idle windows by reading the requests' starts on the
host, which a CUDA graph cannot contain; this kernel handles every row of a fixed-shape step on the device: a row
that completes a window pools it, RMSNorms, RoPEs and stores the entry, any other row does nothing.

`compress(comp, proj, batch, cpool)` takes the engine's objects as they are: the layer's `Compressor` (ratio, dim,
proj_dim, overlap, position_bias, norm_w, eps, rope), the static step's batch (pos, slot, row_valid, groups, pools
with page_table_on_device() and page_tokens) and the layer's `CompressorPool` (ring, ring_size, entries). Its
reference is the layer's own `comp.pool(proj, batch, cpool)`.
"""

from __future__ import annotations

import torch

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None


if tl is not None:

    def _compress_kernel(
        proj_ptr,
        proj_stride,
        pos_ptr,
        slot_ptr,
        valid_ptr,
        ring_ptr,
        ring_stride,
        R,
        bias_ptr,
        normw_ptr,
        eps,
        cos_ptr,
        sin_ptr,
        rope_stride,
        ent_ptr,
        ent_stride,
        pt_ptr,
        pt_stride,
        page_tokens,
        n,
        RATIO: tl.constexpr,
        D: tl.constexpr,
        P: tl.constexpr,
        OVERLAP: tl.constexpr,
        ROPE: tl.constexpr,
        SLOTS: tl.constexpr,
        SLOTS_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        i = tl.program_id(0)
        p = tl.load(pos_ptr + i).to(tl.int64)
        ok = (tl.load(valid_ptr + i) != 0) & ((p + 1) % RATIO == 0)
        if ok:
            dt = proj_ptr.dtype.element_ty
            w = p // RATIO
            first = p - i % n  # position of this request's first row in this forward
            slot = tl.load(slot_ptr + i).to(tl.int64)
            s = tl.arange(0, SLOTS_PAD)
            if OVERLAP:  # slots 0..r-1: previous window, first halves; r..2r-1: this window, second halves
                cur = s >= RATIO
                q = tl.where(cur, w * RATIO + s - RATIO, (w - 1) * RATIO + s)
                half = tl.where(cur, D, 0)
                bias_row = tl.where(cur, s - RATIO, s)
            else:
                q = w * RATIO + s
                half = s * 0
                bias_row = s
            live = (s < SLOTS) & (q >= 0)
            src = tl.where(
                q >= first, proj_ptr + (i - (p - q)) * proj_stride, ring_ptr + (slot * R + q % R) * ring_stride
            )
            c = tl.arange(0, BLOCK_D)
            cm = c < D
            m2 = live[:, None] & cm[None, :]
            bias_base = bias_ptr + bias_row[:, None] * P + half[:, None]
            # the channels ...
            kv = tl.load(src[:, None] + half[:, None] + c[None, :], mask=m2, other=0.0).to(tl.float32)
            g = tl.load(src[:, None] + P + half[:, None] + c[None, :], mask=m2, other=0.0).to(tl.float32)
            g = tl.where(m2, g + tl.load(bias_base + c[None, :], mask=m2, other=0.0), float("-inf"))
            e = tl.exp(g - tl.max(g, axis=0)[None, :])
            wgt = (e / tl.sum(e, axis=0)[None, :]).to(dt).to(tl.float32)
            x = tl.sum((kv * wgt).to(dt).to(tl.float32), axis=0).to(dt).to(tl.float32)
            # ... and each channel's RoPE pair partner (c ^ 1), pooled the same way
            cp = c ^ 1
            kv = tl.load(src[:, None] + half[:, None] + cp[None, :], mask=m2, other=0.0).to(tl.float32)
            g = tl.load(src[:, None] + P + half[:, None] + cp[None, :], mask=m2, other=0.0).to(tl.float32)
            g = tl.where(m2, g + tl.load(bias_base + cp[None, :], mask=m2, other=0.0), float("-inf"))
            e = tl.exp(g - tl.max(g, axis=0)[None, :])
            wgt = (e / tl.sum(e, axis=0)[None, :]).to(dt).to(tl.float32)
            xp = tl.sum((kv * wgt).to(dt).to(tl.float32), axis=0).to(dt).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(tl.where(cm, x * x, 0.0), axis=0) / D + eps)
            y = (tl.load(normw_ptr + c, mask=cm, other=0.0) * (x * r)).to(dt).to(tl.float32)
            yp = (tl.load(normw_ptr + (c ^ 1), mask=cm, other=0.0) * (xp * r)).to(dt).to(tl.float32)
            rc = c - (D - ROPE)
            is_rope = (rc >= 0) & cm
            cosv = tl.load(cos_ptr + w * RATIO * rope_stride + rc, mask=is_rope, other=1.0)
            sinv = tl.load(sin_ptr + w * RATIO * rope_stride + rc, mask=is_rope, other=0.0)
            rot = tl.where(c % 2 == 0, -yp, yp)
            out = tl.where(is_rope, (y * cosv + rot * sinv).to(dt).to(tl.float32), y)
            page = tl.load(pt_ptr + slot * pt_stride + (w * RATIO) // page_tokens).to(tl.int64)
            per_page = page_tokens // RATIO
            row = page * per_page + w % per_page
            tl.store(ent_ptr + row * ent_stride + c, out.to(ent_ptr.dtype.element_ty), mask=cm)


def compress(comp, proj: torch.Tensor, batch, cpool, *, backend: str = "auto") -> None:
    """`comp.pool(proj, batch, cpool)` for a fixed-shape step (one group of n rows per request, row_valid and the
    page table on the device) in one kernel: each live row that completes a window pools its ratio (2 x ratio with
    overlap) slots from this forward's rows or the ring, RMSNorms, RoPEs and stores the entry. Same op order and
    roundings as the reference (which runs where Triton does not, and for windows wider than 16 slots)."""
    table = batch.pools.page_table_on_device()
    slots = 2 * comp.ratio if comp.overlap else comp.ratio
    if not use_triton(backend, [proj, cpool.ring, cpool.entries, table]) or slots > 16:  # wide windows: reference
        comp.pool(proj, batch, cpool)
        return
    T = proj.shape[0]
    if T == 0:
        return
    valid = batch.row_valid.view(torch.uint8) if batch.row_valid.dtype == torch.bool else batch.row_valid
    cos, sin = comp.rope.cos, comp.rope.sin
    jit(_compress_kernel, ("n",))[(T,)](
        proj,
        proj.stride(0),
        batch.pos,
        batch.slot,
        valid,
        cpool.ring,
        cpool.ring.stride(0),
        cpool.ring_size,
        comp.position_bias.contiguous(),
        comp.norm_w,
        float(comp.eps),
        cos,
        sin,
        cos.stride(0),
        cpool.entries,
        cpool.entries.stride(0),
        table,
        table.stride(0),
        batch.pools.page_tokens,
        batch.groups[0].n,
        RATIO=comp.ratio,
        D=comp.dim,
        P=comp.proj_dim,
        OVERLAP=bool(comp.overlap),
        ROPE=cos.shape[-1],
        SLOTS=slots,
        SLOTS_PAD=triton.next_power_of_2(slots),
        BLOCK_D=triton.next_power_of_2(comp.dim),
        num_warps=4,
        enable_fp_fusion=False,
    )
