"""Launch-lean replacements for the engine's many-small-op chains, for the CUDA-graph decode/verify path.

At batch 1 a DeepSeek-V4 step is bound by kernel launches, not bytes: the mHC Sinkhorn alone is ~140 tiny kernels
per hyper-connection, and the eager MoE reads expert counts back to the host (`.tolist()`), which a CUDA graph
cannot contain. Each op here has a Triton kernel (one launch, no host reads, fixed shapes) and a plain PyTorch
reference with the same contract; `backend="auto"` picks Triton on CUDA tensors and the reference elsewhere, so the
same graph-path code runs (un-captured) on the CPU.

- `rms_norm` and `compress` (the non-C2 compressor windows): on the static step's path.
- `hc_pre`, `hc_merge`, `expert_gemv`: the first one-kernel versions of the mHC pre-mix / merge and the routed-expert
  GEMV. The static step now runs `step_hyper` and `step_moe` (fewer launches) instead; these stay as the previous
  chain that benchmarks/step_hyper_gpu.py and step_moe_gpu.py time the new kernels against, and that
  tests/test_cuda_graphs.py checks against the engine's own mHC.

Kernels are built on first use (not at import), so a test that sets TRITON_INTERPRET=1 runs them interpreted.
"""

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None

BACKENDS = ("auto", "triton", "reference")


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto" and os.environ.get("EVALPIPE_GRAPH_OPS") == "reference":  # escape hatch: torch chains
        return False
    if backend == "reference" or triton is None:
        if backend == "triton":
            raise RuntimeError("backend='triton' requested but triton is not installed")
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if backend == "triton":
        if not on_cuda and not _interpret():
            raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1")
        return True
    return on_cuda


# ---- kernel sources (jitted lazily by `_kernels`) ------------------------------------------------------------

if tl is not None:
    def _hc_pre_kernel(streams_ptr, mixes_ptr, base_ptr, scale_ptr, post_ptr, comb_ptr, out_ptr,
                       D, norm_eps, eps, iters,
                       HC: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        K = HC * D
        hs = tl.arange(0, HC)
        offs = tl.arange(0, BLOCK)
        row = streams_ptr + t.to(tl.int64) * K
        ss = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            ss += x * x
        r = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / K + norm_eps)
        M = 2 * HC + HC * HC
        mix = mixes_ptr + t.to(tl.int64) * M
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = tl.sigmoid(tl.load(mix + hs) * r * s0 + tl.load(base_ptr + hs)) + eps
        post = 2.0 * tl.sigmoid(tl.load(mix + HC + hs) * r * s1 + tl.load(base_ptr + HC + hs))
        cidx = 2 * HC + hs[:, None] * HC + hs[None, :]
        c = tl.load(mix + cidx) * r * s2 + tl.load(base_ptr + cidx)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + eps
        c = c / (tl.sum(c, axis=0)[None, :] + eps)
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + eps)
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
        tl.store(post_ptr + t * HC + hs, post)
        tl.store(comb_ptr + t * HC * HC + hs[:, None] * HC + hs[None, :], c)
        for d0 in range(0, D, BLOCK):
            dm = d0 + offs < D
            tile = tl.load(row + hs[:, None] * D + d0 + offs[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
            y = tl.sum(pre[:, None] * tile, axis=0)
            tl.store(out_ptr + t.to(tl.int64) * D + d0 + offs, y.to(out_ptr.dtype.element_ty), mask=dm)


    def _hc_merge_kernel(streams_ptr, block_ptr, post_ptr, comb_ptr, out_ptr, D,
                         HC: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        d0 = tl.program_id(1) * BLOCK
        hs = tl.arange(0, HC)
        offs = d0 + tl.arange(0, BLOCK)
        dm = offs < D
        base = t.to(tl.int64) * HC * D
        s = tl.load(streams_ptr + base + hs[:, None] * D + offs[None, :], mask=dm[None, :], other=0.0).to(tl.float32)
        y = tl.load(block_ptr + t.to(tl.int64) * D + offs, mask=dm, other=0.0).to(tl.float32)
        post = tl.load(post_ptr + t * HC + hs)
        comb = tl.load(comb_ptr + t * HC * HC + hs[:, None] * HC + hs[None, :])  # [j, h]
        mixed = tl.sum(comb[:, :, None] * s[:, None, :], axis=0)  # [h, BLOCK]
        out = post[:, None] * y[None, :] + mixed
        tl.store(out_ptr + base + hs[:, None] * D + offs[None, :], out.to(out_ptr.dtype.element_ty), mask=dm[None, :])


    def _expert_gemv_kernel(x_ptr, idx_ptr, w_ptr, scale_ptr, out_ptr, N, K, x_div,
                            HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        r = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        e = tl.load(idx_ptr + r).to(tl.int64)
        ns = n0 + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        nm = ns < N
        wrow = w_ptr + e * N * K + ns[:, None].to(tl.int64) * K
        xrow = x_ptr + (r // x_div).to(tl.int64) * K
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            km = k0 + ks < K
            x = tl.load(xrow + k0 + ks, mask=km, other=0.0).to(tl.float32)
            w = tl.load(wrow + k0 + ks[None, :], mask=nm[:, None] & km[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + r)
        tl.store(out_ptr + r.to(tl.int64) * N + ns, acc.to(out_ptr.dtype.element_ty), mask=nm)


    def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        xin = tl.load(x_ptr + row * x_stride + offs, mask=m, other=0.0)
        x = xin.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        if HAS_WEIGHT:  # fp32 gain times fp32 normalised row, one rounding (primitives.rms_norm)
            y = tl.load(w_ptr + offs, mask=m, other=0.0) * (x * r)
        else:  # scale rounded to x's dtype, product rounded once (primitives.unweighted_rms_norm)
            y = x * r.to(xin.dtype).to(tl.float32)
        tl.store(out_ptr + row * D + offs, y.to(out_ptr.dtype.element_ty), mask=m)

    def _expert_mm_kernel(x_ptr, idx_ptr, w_ptr, scale_ptr, out_ptr, R, N, K, x_div,
                          HAS_SCALE: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        e = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        rs = tl.arange(0, R_PAD)
        sel = tl.load(idx_ptr + rs, mask=rs < R, other=-1) == e
        used = tl.sum(sel.to(tl.int32), axis=0)
        if used > 0:  # an expert no row picked reads nothing
            ns = n0 + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            nm = ns < N
            xrow = x_ptr + (rs // x_div).to(tl.int64)[:, None] * K
            wcol = w_ptr + e.to(tl.int64) * N * K + ns.to(tl.int64)[None, :] * K
            acc = tl.zeros([R_PAD, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                km = k0 + ks < K
                x = tl.load(xrow + k0 + ks[None, :], mask=sel[:, None] & km[None, :], other=0.0)
                w = tl.load(wcol + k0 + ks[:, None], mask=km[:, None] & nm[None, :], other=0.0)
                if IEEE:  # float32 weights: exact products (Triton's default for a float32 dot is tf32)
                    acc += tl.dot(x.to(w.dtype), w, out_dtype=tl.float32, input_precision="ieee")
                else:
                    acc += tl.dot(x.to(w.dtype), w, out_dtype=tl.float32)
            if HAS_SCALE:
                acc = acc * tl.load(scale_ptr + rs, mask=sel, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + rs.to(tl.int64)[:, None] * N + ns[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=sel[:, None] & nm[None, :])


    def _compress_kernel(proj_ptr, proj_stride, pos_ptr, slot_ptr, valid_ptr, ring_ptr, ring_stride, R,
                         bias_ptr, normw_ptr, eps, cos_ptr, sin_ptr, rope_stride, ent_ptr, ent_stride,
                         pt_ptr, pt_stride, page_tokens, n,
                         RATIO: tl.constexpr, D: tl.constexpr, P: tl.constexpr, OVERLAP: tl.constexpr,
                         ROPE: tl.constexpr, SLOTS: tl.constexpr, SLOTS_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
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
            src = tl.where(q >= first, proj_ptr + (i - (p - q)) * proj_stride,
                           ring_ptr + (slot * R + q % R) * ring_stride)
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


_JIT = {}


def _kernels() -> dict:
    key = _interpret()
    if key not in _JIT:
        _JIT[key] = {f.__name__: triton.jit(f) for f in (_hc_pre_kernel, _hc_merge_kernel, _expert_gemv_kernel,
                                                         _rms_norm_kernel, _expert_mm_kernel, _compress_kernel)}
    return _JIT[key]


# ---- hc_pre ----------------------------------------------------------------------------------------------------

def hc_pre_reference(streams, mixes_raw, base, scale, *, hc: int, iters: int, eps: float, norm_eps: float):
    """Same math as `engine.hyper.HyperConnection.__call__`, from the un-normalised mixes F.linear(x.float(), fn)
    (the RMS scale is a scalar per row, so it commutes with the linear map)."""
    x = streams.flatten(1).float()
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    mixes = mixes_raw * r
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_pre(hc_module, streams: torch.Tensor, *, backend: str = "auto"):
    """(post [T, hc] fp32, comb [T, hc, hc] fp32, collapsed [T, D]) of `engine.hyper.HyperConnection` `hc_module`
    applied to streams [T, hc, D]: one GEMV (cuBLAS) plus one kernel."""
    m = hc_module
    mixes_raw = F.linear(streams.flatten(1).float(), m.fn)
    if not _use_triton(backend, streams, mixes_raw):
        return hc_pre_reference(streams, mixes_raw, m.base, m.scale, hc=m.hc, iters=m.iters, eps=m.eps,
                                norm_eps=m.norm_eps)
    T, hc, D = streams.shape
    streams = streams.contiguous()
    post = torch.empty(T, hc, device=streams.device, dtype=torch.float32)
    comb = torch.empty(T, hc, hc, device=streams.device, dtype=torch.float32)
    out = torch.empty(T, D, device=streams.device, dtype=streams.dtype)
    _kernels()["_hc_pre_kernel"][(T,)](streams, mixes_raw, m.base, m.scale, post, comb, out, D,
                                       float(m.norm_eps), float(m.eps), int(m.iters), HC=hc, BLOCK=512,
                                       num_warps=4)
    return post, comb, out


# ---- hc_merge --------------------------------------------------------------------------------------------------

def hc_merge_reference(streams, block_out, post, comb):
    """Same math as `engine.hyper.HyperConnection.merge`, accumulated in fp32 and rounded once."""
    out = post.unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2),
                                                                                streams.float())
    return out.to(streams.dtype)


def hc_merge(streams, block_out, post, comb, *, backend: str = "auto"):
    if not _use_triton(backend, streams, block_out, post, comb):
        return hc_merge_reference(streams, block_out, post, comb)
    T, hc, D = streams.shape
    streams, block_out = streams.contiguous(), block_out.contiguous()
    out = torch.empty_like(streams)
    block = 256
    _kernels()["_hc_merge_kernel"][(T, triton.cdiv(D, block))](streams, block_out, post.contiguous(),
                                                                comb.contiguous(), out, D, HC=hc, BLOCK=block,
                                                                num_warps=4)
    return out


# ---- expert_gemv -----------------------------------------------------------------------------------------------

def expert_gemv_reference(x, idx, weight, scale=None, *, x_div: int = 1, out_dtype=None):
    rows = x.repeat_interleave(x_div, dim=0) if x_div > 1 else x
    y = torch.bmm(weight[idx].float(), rows.float().unsqueeze(-1)).squeeze(-1)
    if scale is not None:
        y = y * scale.float().unsqueeze(-1)
    return y.to(out_dtype or x.dtype)


def expert_gemv(x, idx, weight, scale=None, *, x_div: int = 1, out_dtype=None, backend: str = "auto"):
    """y [R, N] with y[r] = weight[idx[r]] @ x[r // x_div] (times scale[r]); x [R / x_div, K], idx [R] int,
    weight [E, N, K] (unit stride on K), fp32 accumulation."""
    tensors = [x, idx, weight] + ([scale] if scale is not None else [])
    if not _use_triton(backend, *tensors):
        return expert_gemv_reference(x, idx, weight, scale, x_div=x_div, out_dtype=out_dtype)
    R = idx.numel()
    E, N, K = weight.shape
    out = torch.empty(R, N, device=x.device, dtype=out_dtype or x.dtype)
    r_pad = max(16, triton.next_power_of_2(R))
    if r_pad <= 64:  # few rows (small-batch decode/verify): expert-major, each picked expert's weights read once
        block_n = 16
        _kernels()["_expert_mm_kernel"][(E, triton.cdiv(N, block_n))](
            x.contiguous(), idx.contiguous(), weight, scale if scale is not None else out, out, R, N, K, x_div,
            HAS_SCALE=scale is not None, R_PAD=r_pad, BLOCK_N=block_n, BLOCK_K=256,
            IEEE=weight.dtype == torch.float32, num_warps=4)
        return out
    block_n = 32
    _kernels()["_expert_gemv_kernel"][(R, triton.cdiv(N, block_n))](
        x.contiguous(), idx.contiguous(), weight, scale if scale is not None else out, out, N, K, x_div,
        HAS_SCALE=scale is not None, BLOCK_N=block_n, BLOCK_K=256, num_warps=4)
    return out


# ---- rms_norm --------------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """`engine.primitives.rms_norm` (weight given) or `unweighted_rms_norm` (weight None) over the last dim in one
    kernel instead of ~8 (float, pow, mean, add, rsqrt, mul, mul, cast)."""
    from evalpipe.engine import primitives

    tensors = [x] + ([weight] if weight is not None else [])
    if not _use_triton(backend, *tensors) or x.shape[-1] > 16384:
        return primitives.rms_norm(x, weight, eps) if weight is not None else primitives.unweighted_rms_norm(x, eps)
    D = x.shape[-1]
    # a 2-D row view with unit column stride (a column slice of a GEMM output) is read in place, not copied
    xc = x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()
    out = torch.empty(xc.shape, device=x.device, dtype=x.dtype)
    rows = xc.numel() // D
    if rows:
        _kernels()["_rms_norm_kernel"][(rows,)](xc, xc.stride(0) if xc.dim() == 2 else D,
                                                weight if weight is not None else xc, out, D, float(eps),
                                                HAS_WEIGHT=weight is not None, BLOCK=triton.next_power_of_2(D),
                                                num_warps=4 if D <= 2048 else 8)
    return out


# ---- compressor windows ----------------------------------------------------------------------------------------

def compress(comp, proj: torch.Tensor, batch, cpool, *, backend: str = "auto") -> None:
    """`engine.compressor.Compressor.pool` for a fixed-shape step (one group of n rows per request, row_valid and
    the page table on the device) in one kernel: each live row that completes a window pools its ratio (2 x ratio
    with overlap) slots from this forward's rows or the ring, RMSNorms, RoPEs and stores the entry. Same op order
    and roundings as the reference (which runs where Triton does not)."""
    table = batch.pools.page_table_on_device()
    slots = 2 * comp.ratio if comp.overlap else comp.ratio
    if not _use_triton(backend, proj, cpool.ring, cpool.entries, table) or slots > 16:  # wide windows: reference
        comp.pool(proj, batch, cpool)
        return
    T = proj.shape[0]
    if T == 0:
        return
    valid = batch.row_valid.view(torch.uint8) if batch.row_valid.dtype == torch.bool else batch.row_valid
    cos, sin = comp.rope.cos, comp.rope.sin
    _kernels()["_compress_kernel"][(T,)](
        proj, proj.stride(0), batch.pos, batch.slot, valid, cpool.ring, cpool.ring.stride(0), cpool.ring_size,
        comp.position_bias.contiguous(), comp.norm_w, float(comp.eps), cos, sin, cos.stride(0),
        cpool.entries, cpool.entries.stride(0), table, table.stride(0), batch.pools.page_tokens,
        batch.groups[0].n,
        RATIO=comp.ratio, D=comp.dim, P=comp.proj_dim, OVERLAP=bool(comp.overlap), ROPE=cos.shape[-1],
        SLOTS=slots, SLOTS_PAD=triton.next_power_of_2(slots), BLOCK_D=triton.next_power_of_2(comp.dim),
        num_warps=4, enable_fp_fusion=False)
