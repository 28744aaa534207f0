"""The one-kernel mHC pre-mix / merge and routed-expert GEMV that the static step ran before kernels/hyper.py and
kernels/moe.py: the baselines benchmarks/kernels/step_hyper_gpu.py and step_moe_gpu.py time those kernels against
(and that tests/engine/test_cuda_graphs.py checks against the engine's own mHC). Not part of the package: nothing
serves with them.

Each op has a Triton kernel and a PyTorch reference with the same contract, behind evalpipe.kernels' backend
selector and JIT cache (`backend="auto"`: Triton on CUDA tensors, the reference elsewhere).
"""

import torch
import torch.nn.functional as F

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None


# ---- kernel sources (built on first use by `jit`) -------------------------------------------------------------

if tl is not None:

    def _hc_pre_kernel(
        streams_ptr,
        mixes_ptr,
        base_ptr,
        scale_ptr,
        post_ptr,
        comb_ptr,
        out_ptr,
        D,
        norm_eps,
        eps,
        iters,
        HC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
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

    def _hc_merge_kernel(streams_ptr, block_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK: tl.constexpr):
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

    def _expert_gemv_kernel(
        x_ptr,
        idx_ptr,
        w_ptr,
        scale_ptr,
        out_ptr,
        N,
        K,
        x_div,
        HAS_SCALE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
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

    def _expert_mm_kernel(
        x_ptr,
        idx_ptr,
        w_ptr,
        scale_ptr,
        out_ptr,
        R,
        N,
        K,
        x_div,
        HAS_SCALE: tl.constexpr,
        R_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
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
            tl.store(
                out_ptr + rs.to(tl.int64)[:, None] * N + ns[None, :],
                acc.to(out_ptr.dtype.element_ty),
                mask=sel[:, None] & nm[None, :],
            )


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
    if not use_triton(backend, [streams, mixes_raw]):
        return hc_pre_reference(
            streams, mixes_raw, m.base, m.scale, hc=m.hc, iters=m.iters, eps=m.eps, norm_eps=m.norm_eps
        )
    T, hc, D = streams.shape
    streams = streams.contiguous()
    post = torch.empty(T, hc, device=streams.device, dtype=torch.float32)
    comb = torch.empty(T, hc, hc, device=streams.device, dtype=torch.float32)
    out = torch.empty(T, D, device=streams.device, dtype=streams.dtype)
    jit(_hc_pre_kernel)[(T,)](
        streams,
        mixes_raw,
        m.base,
        m.scale,
        post,
        comb,
        out,
        D,
        float(m.norm_eps),
        float(m.eps),
        int(m.iters),
        HC=hc,
        BLOCK=512,
        num_warps=4,
    )
    return post, comb, out


# ---- hc_merge --------------------------------------------------------------------------------------------------


def hc_merge_reference(streams, block_out, post, comb):
    """Same math as `engine.hyper.HyperConnection.merge`, accumulated in fp32 and rounded once."""
    out = post.unsqueeze(-1) * block_out.float().unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams.float())
    return out.to(streams.dtype)


def hc_merge(streams, block_out, post, comb, *, backend: str = "auto"):
    if not use_triton(backend, [streams, block_out, post, comb]):
        return hc_merge_reference(streams, block_out, post, comb)
    T, hc, D = streams.shape
    streams, block_out = streams.contiguous(), block_out.contiguous()
    out = torch.empty_like(streams)
    block = 256
    jit(_hc_merge_kernel)[(T, triton.cdiv(D, block))](
        streams, block_out, post.contiguous(), comb.contiguous(), out, D, HC=hc, BLOCK=block, num_warps=4
    )
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
    if not use_triton(backend, tensors):
        return expert_gemv_reference(x, idx, weight, scale, x_div=x_div, out_dtype=out_dtype)
    R = idx.numel()
    E, N, K = weight.shape
    out = torch.empty(R, N, device=x.device, dtype=out_dtype or x.dtype)
    r_pad = max(16, triton.next_power_of_2(R))
    if r_pad <= 64:  # few rows (small-batch decode/verify): expert-major, each picked expert's weights read once
        block_n = 16
        jit(_expert_mm_kernel)[(E, triton.cdiv(N, block_n))](
            x.contiguous(),
            idx.contiguous(),
            weight,
            scale if scale is not None else out,
            out,
            R,
            N,
            K,
            x_div,
            HAS_SCALE=scale is not None,
            R_PAD=r_pad,
            BLOCK_N=block_n,
            BLOCK_K=256,
            IEEE=weight.dtype == torch.float32,
            num_warps=4,
        )
        return out
    block_n = 32
    jit(_expert_gemv_kernel)[(R, triton.cdiv(N, block_n))](
        x.contiguous(),
        idx.contiguous(),
        weight,
        scale if scale is not None else out,
        out,
        N,
        K,
        x_div,
        HAS_SCALE=scale is not None,
        BLOCK_N=block_n,
        BLOCK_K=256,
        num_warps=4,
    )
    return out
