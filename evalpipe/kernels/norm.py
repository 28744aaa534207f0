"""RMSNorm: the model's two roundings (its references) and one-kernel versions for the CUDA-graph step.

- `rms_norm_reference` / `unweighted_rms_norm_reference` are the engine model's norms (engine/model/primitives.py
  imports them): written to round like transformers' DeepSeek-V4 in float32, fused torch kernels where they give
  the same float32 result.
- `rms_norm(x, weight, eps)`: either norm over the last dim in one kernel instead of ~8 (float, pow, mean, add,
  rsqrt, mul, mul, cast); weight None is the unweighted norm.
- `qkv_norm(q_src, kv_src, kv_w, heads, eps)` -> [T, heads + 1, D]: heads 0..H-1 are
  `unweighted_rms_norm(q_src[t, h*D:(h+1)*D])`, head H is `rms_norm(kv_src[t], kv_w)` -- the layout the RoPE site
  (`q_rope_store` or `apply_rope`) takes, so no `cat`. Inputs may be strided row views (column slices of a GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; the (float32) gain multiplies before the single cast back, as DeepSeek-V4 does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype) if weight is not None else xf.to(x.dtype)


def unweighted_rms_norm_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Gain-free RMSNorm whose scale is computed in float32 but applied in x's dtype (q heads, mHC inputs)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


if tl is not None:

    def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, D, eps, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        xin = tl.load(x_ptr + row * x_stride + offs, mask=m, other=0.0)
        x = xin.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        if HAS_WEIGHT:  # fp32 gain times fp32 normalised row, one rounding (rms_norm_reference)
            y = tl.load(w_ptr + offs, mask=m, other=0.0) * (x * r)
        else:  # scale rounded to x's dtype, product rounded once (unweighted_rms_norm_reference)
            y = x * r.to(xin.dtype).to(tl.float32)
        tl.store(out_ptr + row * D + offs, y.to(out_ptr.dtype.element_ty), mask=m)

    def _qkv_norm_kernel(q_ptr, q_stride, kv_ptr, kv_stride, w_ptr, out_ptr, H, D, eps, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK)
        m = offs < D
        if h < H:  # a query head: gain-free, scale rounded to x's dtype, one rounded product
            xin = tl.load(q_ptr + t * q_stride + h * D + offs, mask=m, other=0.0)
            x = xin.to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            y = x * r.to(xin.dtype).to(tl.float32)
        else:  # the shared K=V head: fp32 gain times the fp32 normalised row, one rounding
            x = tl.load(kv_ptr + t * kv_stride + offs, mask=m, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            y = tl.load(w_ptr + offs, mask=m, other=0.0) * (x * r)
        tl.store(out_ptr + (t * (H + 1) + h) * D + offs, y.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, backend: str = "auto") -> torch.Tensor:
    """`rms_norm_reference` (weight given) or `unweighted_rms_norm_reference` (weight None) in one kernel."""
    tensors = [x] + ([weight] if weight is not None else [])
    if not use_triton(backend, tensors) or x.shape[-1] > 16384:
        return rms_norm_reference(x, weight, eps) if weight is not None else unweighted_rms_norm_reference(x, eps)
    D = x.shape[-1]
    # a 2-D row view with unit column stride (a column slice of a GEMM output) is read in place, not copied
    xc = x if x.dim() == 2 and x.stride(1) == 1 else x.contiguous()
    out = torch.empty(xc.shape, device=x.device, dtype=x.dtype)
    rows = xc.numel() // D
    if rows:
        jit(_rms_norm_kernel)[(rows,)](
            xc,
            xc.stride(0) if xc.dim() == 2 else D,
            weight if weight is not None else xc,
            out,
            D,
            float(eps),
            HAS_WEIGHT=weight is not None,
            BLOCK=triton.next_power_of_2(D),
            num_warps=4 if D <= 2048 else 8,
        )
    return out


def qkv_norm_reference(
    q_src: torch.Tensor, kv_src: torch.Tensor, kv_w: torch.Tensor, heads: int, eps: float
) -> torch.Tensor:
    T, D = kv_src.shape
    q = unweighted_rms_norm_reference(q_src.reshape(T, heads, D), eps)
    kv = rms_norm_reference(kv_src, kv_w, eps)
    return torch.cat([q, kv.unsqueeze(1)], dim=1)


def qkv_norm(
    q_src: torch.Tensor, kv_src: torch.Tensor, kv_w: torch.Tensor, heads: int, eps: float, *, backend: str = "auto"
) -> torch.Tensor:
    """[T, heads + 1, D]: normalised query heads then the normalised shared K=V head (see module docstring).
    q_src [T, heads * D] and kv_src [T, D] need unit stride on the last dim only."""
    if not use_triton(backend, [q_src, kv_src, kv_w]) or kv_src.shape[-1] > 16384:
        return qkv_norm_reference(q_src, kv_src, kv_w, heads, eps)
    T, D = kv_src.shape
    if q_src.shape != (T, heads * D) or q_src.stride(-1) != 1 or kv_src.stride(-1) != 1:
        raise ValueError(f"q_src must be [T, {heads} * {D}] and kv_src [T, {D}] with unit last stride")
    out = torch.empty(T, heads + 1, D, device=kv_src.device, dtype=kv_src.dtype)
    if T:
        jit(_qkv_norm_kernel)[(T, heads + 1)](
            q_src,
            q_src.stride(0),
            kv_src,
            kv_src.stride(0),
            kv_w,
            out,
            heads,
            D,
            float(eps),
            BLOCK=triton.next_power_of_2(D),
            num_warps=4,
        )
    return out
