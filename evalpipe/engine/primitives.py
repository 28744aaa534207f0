"""Small numeric building blocks shared by the layers, written to round like transformers' DeepSeek-V4 in float32."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; the (float32) gain multiplies before the single cast back, as DeepSeek-V4 does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(dtype) if weight is not None else xf.to(dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Gain-free RMSNorm whose scale is computed in float32 but applied in x's dtype (q heads, mHC inputs)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing `cos.shape[-1]` channels of x: pair (2i, 2i+1) rotates by angle i.

    x is [..., rows, (heads,) dim]; cos/sin are [rows, rope_dim] (already repeated per pair) and broadcast over
    the heads axis when x has one. Pass `-sin` for the inverse rotation."""
    rd = cos.shape[-1]
    if x.dim() == cos.dim() + 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    nope, rope = x[..., :-rd], x[..., -rd:]
    pairs = rope.unflatten(-1, (rd // 2, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = ((rope.float() * cos) + (rotated_half.float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
