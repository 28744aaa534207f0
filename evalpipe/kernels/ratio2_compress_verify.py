"""Ratio-2 ("C2") KV compression for fixed-width target verify: pair pooling, RMSNorm, RoPE and paged store in one op.

The engine's ratio-2 compressed layers follow transformers' `DeepseekV4HCACompressor` at compress rate 2: token
pair (p, p+1) with p even becomes one compressed entry (index p // 2) whose RoPE position is the window start p.
During verify every request runs `rows_per_request` (D) consecutive positions; this op consumes the already
projected rows and does everything after the projection.

Signature (all tensors on one device)::

    ratio2_compress_verify(kv_gate, positions, req, row_valid, position_bias, norm_weight, eps, cos, sin, rope_dim,
              kv_state, pool, page_table, page_size, ring_size, rows_per_request, *, backend="auto") -> None

- kv_gate [N, 2*hd] fp32|bf16 (fp16: reference only), unit column stride (any row stride): row =
  [kv_proj(x) | gate_proj(x)]; its dtype is the compute dtype of the chain (see the rounding points below).
  Rows are request-major blocks of D rows with consecutive positions: rows b*D .. b*D+D-1 belong to one request.
- positions [N] int32|int64 absolute token positions; req [N] int32|int64 request slot (ring block and
  page_table row).
- row_valid [N] bool or integer (nonzero = live). A padding row (row_valid false) reads nothing and writes
  nothing; its positions/req may hold anything (CUDA-graph padding).
- position_bias [2, hd] fp32 (slot = pos % 2); norm_weight [hd] fp32; eps float.
- cos, sin [max_pos, rope_dim // 2] fp32: the compress-RoPE tables (interleaved pairs on the last rope_dim dims).
- kv_state [n_req_slots * ring_size, 2*hd], dtype of kv_gate or fp32 (must hold a row exactly): the per-request ring;
  request r, position p lives at row r*ring_size + p % ring_size.
- pool [n_slots, hd] (model dtype, unit column stride): compressed-KV pool. Entry e = pos // 2 of request r is stored
  at slot page_table[r, e // page_size] * page_size + e % page_size; page_table [n_req_slots, P] int32|int64.

Per live row (j = row % D), with c(.) = round to the compute dtype, i.e. kv_gate.dtype (identity for fp32)::

    even pos: kv_state[req*R + pos % R] = kv_gate[row]               (park only; nothing else written)
    odd pos:  partner = kv_state[req*R + (pos-1) % R] if j == 0 else kv_gate[row-1]
              s0 = f32(gate_partner) + bias[0];  s1 = f32(gate_row) + bias[1]          # fp32
              d = s0 - s1; e = exp(-|d|); (w0, w1) = (1, e) if d > 0 else (e, 1); (w0, w1) /= (1 + e)
              x = c(c(kv_partner * c(w0)) + c(kv_row * c(w1)))       # softmax weights and pooling as transformers
              x = c(norm_weight * (f32(x) * rsqrt(mean(f32(x)^2) + eps)))     # transformers' kv_norm order
              x = apply_interleaved_rope(x, cos[pos-1], sin[pos-1])   # evalpipe.kernels.rope: fp32, no FMA,
                                                                       # e' = e*c - o*s; o' = e*s + o*c; then c()
              pool[slot(req, pos // 2)] = pool.dtype(x)

These are the rounding points of transformers' `DeepseekV4HCACompressor` (and the engine's `Compressor.pool`) run
in the dtype of the projection: `softmax(gate + bias, fp32).to(kv.dtype)`, `(kv * w).sum()` in kv's dtype, kv_norm,
RoPE, cast to the pool. The closed-form softmax is what softmax over two values computes (one of exp(a - max),
exp(b - max) is exactly 1, and each weight is that over 1 + e). fp16 inputs run the reference only.

Why D rows in one launch equal D single-row launches bitwise: a later row's partner is the previous row of the
launch, and the ring row a single-row launch would read is a bit copy of that same row; every other step is per row.
Only the block head reads the ring, at slot (pos0 - 1) % R, and the launch's rows write slots pos0 .. pos0+D-1
(mod R), which miss it iff R > D: hence `ring_size <= rows_per_request` raises.

Rollback needs no undo: the ring is addressed by absolute position, so after accepting k of D rows the next launch
starts at pos0 + k and its head reads slot (pos0 + k - 1) % R, last written by an accepted row (or earlier), because
rejected rows only wrote slots of positions pos0+k .. pos0+D-1, fewer than R distinct ones. Those positions, and
the pool entries rejected odd rows wrote, are rewritten when the next launch re-verifies them.

Exactness: the Triton kernel equals the reference bitwise on the ring (a copy). Pool entries: bitwise under the
CPU interpreter (tests); on GPU within one unit in the last place of the pool dtype (the sum of squares is reduced
in another order than torch's mean, and exp/rsqrt are CUDA's expf/rsqrtf as in torch). `ratio2_compress_verify` over D
rows equals D single-row launches bitwise, in both backends.
"""

from __future__ import annotations

import torch

from evalpipe.kernels._backend import interpret_mode, jit, use_triton
from evalpipe.kernels.rope import apply_interleaved_rope

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # pragma: no cover - triton is optional on non-Linux hosts
    triton = None


def _validate(
    kv_gate,
    positions,
    req,
    row_valid,
    position_bias,
    norm_weight,
    eps,
    cos,
    sin,
    rope_dim,
    kv_state,
    pool,
    page_table,
    page_size,
    ring_size,
    rows_per_request,
) -> int:
    """Shape/dtype checks shared by both backends (host-side metadata only, so CUDA-graph safe). Takes the op's
    arguments in its signature's order, so a caller holding them as a tuple passes `*args`; eps is not checked.
    Returns hd."""
    if ring_size <= rows_per_request:
        raise ValueError(
            f"ring_size ({ring_size}) must be wider than rows_per_request ({rows_per_request}): the block head's "
            "ring slot would be overwritten inside the launch"
        )
    if rows_per_request < 1:
        raise ValueError(f"rows_per_request must be >= 1, got {rows_per_request}")
    if kv_gate.dim() != 2 or kv_gate.shape[1] % 2:
        raise ValueError(f"kv_gate must be [N, 2*hd], got {tuple(kv_gate.shape)}")
    n, hd = kv_gate.shape[0], kv_gate.shape[1] // 2
    if n % rows_per_request:
        raise ValueError(f"rows ({n}) must be a multiple of rows_per_request ({rows_per_request})")
    for name, t in (("positions", positions), ("req", req), ("row_valid", row_valid)):
        if t.shape != (n,):
            raise ValueError(f"{name} must be [{n}], got {tuple(t.shape)}")
    for name, t in (("positions", positions), ("req", req), ("page_table", page_table)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if position_bias.shape != (2, hd) or norm_weight.shape != (hd,):
        raise ValueError(f"position_bias must be [2, {hd}] and norm_weight [{hd}]")
    if rope_dim % 2 or not 0 <= rope_dim <= hd or (hd - rope_dim) % 2:
        raise ValueError(f"rope_dim must be even, <= hd ({hd}), with an even nope part; got {rope_dim}")
    if cos.dim() != 2 or cos.shape[1] != rope_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must both be [max_pos, {rope_dim // 2}]")
    if kv_state.dim() != 2 or kv_state.shape[1] != 2 * hd or kv_state.shape[0] % ring_size:
        raise ValueError(f"kv_state must be [n_req_slots*{ring_size}, {2 * hd}], got {tuple(kv_state.shape)}")
    if kv_state.dtype not in (kv_gate.dtype, torch.float32):
        raise ValueError(f"kv_state dtype {kv_state.dtype} cannot hold {kv_gate.dtype} rows exactly")
    if pool.dim() != 2 or pool.shape[1] != hd:
        raise ValueError(f"pool must be [n_slots, {hd}], got {tuple(pool.shape)}")
    if page_table.dim() != 2 or page_size < 1:
        raise ValueError("page_table must be [n_req_slots, pages] and page_size >= 1")
    return hd


def _masked_row_store(dst: torch.Tensor, index: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    """dst[index[i]] = values[i] where mask[i], without data-dependent shapes (CUDA-graph capturable).

    Rows that must not write are redirected to copy the first writer's (index, value) -- duplicates that write the
    same bytes, so the scatter stays deterministic; with no writer at all they rewrite dst[0] with itself.
    """
    # index_select with a 1-element index tensor, never `t[0-d tensor]`: that form calls .item() (a host sync that
    # breaks CUDA-graph capture).
    first = torch.argmax(mask.to(torch.int32)).view(1)  # first True, or 0 when none
    has_writer = mask.index_select(0, first)
    fallback_index = torch.where(has_writer, index.index_select(0, first), torch.zeros_like(index[:1]))
    fallback_value = torch.where(has_writer[:, None], values.index_select(0, first), dst[:1])
    index = torch.where(mask, index, fallback_index)
    values = torch.where(mask[:, None], values, fallback_value)
    dst.index_copy_(0, index, values)


def ratio2_compress_verify_reference(
    kv_gate,
    positions,
    req,
    row_valid,
    position_bias,
    norm_weight,
    eps,
    cos,
    sin,
    rope_dim,
    kv_state,
    pool,
    page_table,
    page_size,
    ring_size,
    rows_per_request,
) -> None:
    """The unfused chain in plain PyTorch (vectorised, no host syncs). Same contract as `ratio2_compress_verify`."""
    hd = _validate(
        kv_gate,
        positions,
        req,
        row_valid,
        position_bias,
        norm_weight,
        eps,
        cos,
        sin,
        rope_dim,
        kv_state,
        pool,
        page_table,
        page_size,
        ring_size,
        rows_per_request,
    )
    n, dev = kv_gate.shape[0], kv_gate.device
    if n == 0:
        return
    live = row_valid.to(torch.bool)
    pos = torch.where(live, positions.to(torch.int64), 0)  # padding rows read harmless in-range places
    rq = torch.where(live, req.to(torch.int64), 0)
    is_head = (torch.arange(n, device=dev) % rows_per_request) == 0
    odd = (pos % 2) == 1

    cdt = kv_gate.dtype  # compute dtype of the chain, as transformers runs it in the projection's dtype
    rows = kv_gate
    ring_rows = kv_state[rq * ring_size + (pos - 1) % ring_size].to(cdt)  # exact: the ring holds cdt values
    prev_rows = torch.cat([rows[:1], rows[:-1]], dim=0)
    partner = torch.where(is_head[:, None], ring_rows, prev_rows)

    # 2-way softmax over the pair's gate + position bias, per channel, fp32 (closed form), weights cast to cdt.
    s0 = partner[:, hd:].float() + position_bias[0].float()
    s1 = rows[:, hd:].float() + position_bias[1].float()
    d = s0 - s1
    e = torch.exp(-d.abs())
    one = torch.ones_like(e)
    w0 = (torch.where(d > 0, one, e) / (1 + e)).to(cdt)
    w1 = (torch.where(d > 0, e, one) / (1 + e)).to(cdt)
    pooled = partner[:, :hd] * w0 + rows[:, :hd] * w1  # products and sum rounded to cdt

    # RMSNorm, transformers' kv_norm order: x * rsqrt(mean(x^2) + eps), then fp32 weight * x, round once.
    x = pooled.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    normed = (norm_weight.float() * x).to(cdt)

    rope_pos = (pos - 1).clamp(min=0)
    entry_vals = apply_interleaved_rope(normed, cos[rope_pos].float(), sin[rope_pos].float()).to(pool.dtype)

    entry = pos // 2
    slot = page_table[rq, entry // page_size].to(torch.int64) * page_size + entry % page_size
    _masked_row_store(kv_state, rq * ring_size + pos % ring_size, kv_gate.to(kv_state.dtype), live & ~odd)
    _masked_row_store(pool, slot, entry_vals, live & odd)


if triton is not None:

    def _round_to(x, TO_BF16: tl.constexpr):
        """Round fp32 to bf16 when TO_BF16 (round-to-nearest-even from the bits; else identity), kept in fp32.

        Built from integer ops because Triton's CPU interpreter truncates in `.to(tl.bfloat16)`; on GPU this is
        the same RNE that `cvt.rn.bf16.f32` does.
        """
        if TO_BF16:
            bits = x.to(tl.int32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
            x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        return x

    def _exp(x, LIBDEVICE: tl.constexpr):
        """exp as torch computes it on the same device: CUDA's expf on GPU, numpy's exp in the CPU interpreter."""
        if LIBDEVICE:
            return libdevice.exp(x)
        return tl.exp(x)

    def _rsqrt(x, LIBDEVICE: tl.constexpr):
        if LIBDEVICE:
            return libdevice.rsqrt(x)
        return 1.0 / tl.sqrt_rn(x)

    def _ratio2_compress_verify_kernel(
        kvg_ptr,
        kvg_stride,
        pos_ptr,
        req_ptr,
        valid_ptr,
        bias_ptr,
        normw_ptr,
        eps,
        cos_ptr,
        sin_ptr,
        cos_stride,
        sin_stride,
        ring_ptr,
        ring_stride,
        pool_ptr,
        pool_stride,
        pt_ptr,
        pt_stride,
        page_size,
        R,
        D,
        HD: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK: tl.constexpr,
        C_BF16: tl.constexpr,
        P_BF16: tl.constexpr,
        LIBDEVICE: tl.constexpr,
    ):
        """One program per row; masked loads/stores instead of branches so padding rows touch no memory.

        Every load is issued before the first store (one dependent round trip after the row's metadata), which
        is what keeps a 6-row launch short.
        """
        row = tl.program_id(0).to(tl.int64)
        live = tl.load(valid_ptr + row) != 0
        pos = tl.load(pos_ptr + row).to(tl.int64)  # a row's own metadata is always in range
        rq = tl.load(req_ptr + row).to(tl.int64)
        odd = (pos % 2) == 1
        is_head = (row % D) == 0

        offs = tl.arange(0, BLOCK)
        inb = offs < HD
        zero = offs * 0  # scalar conditions are widened to vectors before use as masks (interpreter needs it)
        swp = offs ^ 1  # RoPE pair partner channel
        mine = inb & ((zero + live.to(tl.int32)) != 0)
        park = mine & ((zero + (pos % 2 == 0).to(tl.int32)) != 0)  # even: park the row in the ring, nothing else
        work = mine & ((zero + odd.to(tl.int32)) != 0)  # odd: complete the pair and store the entry
        from_ring = work & ((zero + is_head.to(tl.int32)) != 0)  # block head: partner from the ring
        from_prev = work & ((zero + is_head.to(tl.int32)) == 0)  # later rows: previous row of this launch

        row_ptr = kvg_ptr + row * kvg_stride
        prev_ptr = kvg_ptr + (row - 1) * kvg_stride
        ring_src = ring_ptr + (rq * R + (pos - 1 + R) % R) * ring_stride
        entry = pos // 2
        rpos = tl.maximum(pos - 1, 0)
        is_rope = offs >= HD - ROPE
        pair = (offs - (HD - ROPE)) // 2
        rmask = work & is_rope

        # ---- loads: channel c and its RoPE partner channel c ^ 1 (recomputed, so no cross-lane shuffle)
        kv_raw = tl.load(row_ptr + offs, mask=mine, other=0.0)
        g_raw = tl.load(row_ptr + HD + offs, mask=mine, other=0.0)
        kv_new_s = tl.load(row_ptr + swp, mask=work, other=0.0).to(tl.float32)
        g_new_s = tl.load(row_ptr + HD + swp, mask=work, other=0.0).to(tl.float32)
        kv_old = tl.where(
            from_ring,
            tl.load(ring_src + offs, mask=from_ring, other=0.0).to(tl.float32),
            tl.load(prev_ptr + offs, mask=from_prev, other=0.0).to(tl.float32),
        )
        g_old = tl.where(
            from_ring,
            tl.load(ring_src + HD + offs, mask=from_ring, other=0.0).to(tl.float32),
            tl.load(prev_ptr + HD + offs, mask=from_prev, other=0.0).to(tl.float32),
        )
        kv_old_s = tl.where(
            from_ring,
            tl.load(ring_src + swp, mask=from_ring, other=0.0).to(tl.float32),
            tl.load(prev_ptr + swp, mask=from_prev, other=0.0).to(tl.float32),
        )
        g_old_s = tl.where(
            from_ring,
            tl.load(ring_src + HD + swp, mask=from_ring, other=0.0).to(tl.float32),
            tl.load(prev_ptr + HD + swp, mask=from_prev, other=0.0).to(tl.float32),
        )
        b0 = tl.load(bias_ptr + offs, mask=work, other=0.0).to(tl.float32)
        b1 = tl.load(bias_ptr + HD + offs, mask=work, other=0.0).to(tl.float32)
        b0s = tl.load(bias_ptr + swp, mask=work, other=0.0).to(tl.float32)
        b1s = tl.load(bias_ptr + HD + swp, mask=work, other=0.0).to(tl.float32)
        wn = tl.load(normw_ptr + offs, mask=work, other=0.0).to(tl.float32)
        wns = tl.load(normw_ptr + swp, mask=work, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + rpos * cos_stride + pair, mask=rmask, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + rpos * sin_stride + pair, mask=rmask, other=0.0).to(tl.float32)
        page = tl.load(pt_ptr + rq * pt_stride + entry // page_size + zero, mask=work, other=0).to(tl.int64)

        # ---- pair pooling (closed-form 2-way softmax, fp32), RMSNorm, RoPE
        kv_new = kv_raw.to(tl.float32)
        g_new = g_raw.to(tl.float32)
        d = (g_old + b0) - (g_new + b1)
        e = _exp(-tl.abs(d), LIBDEVICE)
        w0 = _round_to(tl.div_rn(tl.where(d > 0, 1.0, e), 1.0 + e), C_BF16)
        w1 = _round_to(tl.div_rn(tl.where(d > 0, e, 1.0), 1.0 + e), C_BF16)
        x = _round_to(_round_to(kv_old * w0, C_BF16) + _round_to(kv_new * w1, C_BF16), C_BF16)
        ds = (g_old_s + b0s) - (g_new_s + b1s)
        es = _exp(-tl.abs(ds), LIBDEVICE)
        w0s = _round_to(tl.div_rn(tl.where(ds > 0, 1.0, es), 1.0 + es), C_BF16)
        w1s = _round_to(tl.div_rn(tl.where(ds > 0, es, 1.0), 1.0 + es), C_BF16)
        xs = _round_to(_round_to(kv_old_s * w0s, C_BF16) + _round_to(kv_new_s * w1s, C_BF16), C_BF16)

        x = tl.where(inb, x, 0.0)
        rs = _rsqrt(tl.div_rn(tl.sum(x * x, axis=0), HD * 1.0) + eps, LIBDEVICE)
        n = _round_to(wn * (x * rs), C_BF16)
        ns = _round_to(wns * (xs * rs), C_BF16)

        first = (offs % 2) == 0
        ev = tl.where(first, n, ns)
        od = tl.where(first, ns, n)
        rot = tl.where(first, ev * c - od * s, ev * s + od * c)
        outv = _round_to(tl.where(is_rope, _round_to(rot, C_BF16), n), P_BF16)

        # ---- stores: ring park (bit copy) for even rows, the pool entry (exact cast) for odd rows
        ring_dst = ring_ptr + (rq * R + pos % R) * ring_stride
        tl.store(ring_dst + offs, kv_raw.to(ring_ptr.dtype.element_ty), mask=park)
        tl.store(ring_dst + HD + offs, g_raw.to(ring_ptr.dtype.element_ty), mask=park)
        slot = page * page_size + entry % page_size
        tl.store(pool_ptr + slot * pool_stride + offs, outv.to(pool_ptr.dtype.element_ty), mask=work)


# device functions the kernels call, in dependency order (kernels._backend.jit gives each kernel them jitted)
_HELPERS = (_round_to, _exp, _rsqrt) if triton is not None else ()


def _triton_guard(kv_gate, cos, sin, kv_state, pool) -> bool:
    return (
        kv_gate.stride(1) == 1
        and kv_state.stride(1) == 1
        and pool.stride(1) == 1
        and (cos.numel() == 0 or cos.stride(1) == 1)
        and (sin.numel() == 0 or sin.stride(1) == 1)
        and kv_gate.dtype in (torch.float32, torch.bfloat16)
        and pool.dtype in (torch.float32, torch.bfloat16)
    )


def ratio2_compress_verify(
    kv_gate,
    positions,
    req,
    row_valid,
    position_bias,
    norm_weight,
    eps,
    cos,
    sin,
    rope_dim,
    kv_state,
    pool,
    page_table,
    page_size,
    ring_size,
    rows_per_request,
    *,
    backend: str = "auto",
) -> None:
    """Fused ratio-2 verify compression (see module docstring for the contract). Writes kv_state and pool in place."""
    args = (
        kv_gate,
        positions,
        req,
        row_valid,
        position_bias,
        norm_weight,
        eps,
        cos,
        sin,
        rope_dim,
        kv_state,
        pool,
        page_table,
        page_size,
        ring_size,
        rows_per_request,
    )
    hd = _validate(*args)
    tensors = [kv_gate, positions, req, row_valid, position_bias, norm_weight, cos, sin, kv_state, pool, page_table]
    if not use_triton(backend, tensors, _triton_guard(kv_gate, cos, sin, kv_state, pool)):
        ratio2_compress_verify_reference(*args)
        return
    n = kv_gate.shape[0]
    if n == 0:
        return
    jit(_ratio2_compress_verify_kernel, helpers=_HELPERS)[(n,)](
        kv_gate,
        kv_gate.stride(0),
        positions,
        req,
        row_valid if row_valid.dtype != torch.bool else row_valid.view(torch.uint8),
        position_bias.contiguous(),
        norm_weight.contiguous(),
        float(eps),
        cos,
        sin,
        max(cos.stride(0), 1),
        max(sin.stride(0), 1),
        kv_state,
        kv_state.stride(0),
        pool,
        pool.stride(0),
        page_table,
        page_table.stride(0),
        page_size,
        ring_size,
        rows_per_request,
        HD=hd,
        ROPE=rope_dim,
        BLOCK=triton.next_power_of_2(hd),
        C_BF16=kv_gate.dtype == torch.bfloat16,
        P_BF16=pool.dtype == torch.bfloat16,
        LIBDEVICE=kv_gate.is_cuda and not interpret_mode(),
        num_warps=4 if hd >= 256 else 1,
        enable_fp_fusion=False,
    )
