"""Small numeric building blocks shared by the layers, written to round like transformers' DeepSeek-V4 in float32
(fused torch kernels where they give the same float32 result, fewer ops where the CPU is op-overhead bound).

The two RMSNorms are defined once, in evalpipe.kernels.norm, as the references of the CUDA step's norm kernels."""

from __future__ import annotations

import torch

from evalpipe.kernels.norm import rms_norm_reference as rms_norm  # noqa: F401
from evalpipe.kernels.norm import unweighted_rms_norm_reference as unweighted_rms_norm  # noqa: F401


def rotate_half_matrix(rope_dim: int, device=None) -> torch.Tensor:
    """R with (x @ R) = interleaved rotate-half of x: pair (e, o) -> (-o, e). Exact in floating point (one signed
    term per output, the rest zeros), so RoPE below rounds exactly like transformers' formula."""
    r = torch.zeros(rope_dim, rope_dim)
    idx = torch.arange(0, rope_dim, 2)
    r[idx + 1, idx] = -1.0
    r[idx, idx + 1] = 1.0
    return r.to(device)


_ROT: dict[tuple[int, str], torch.Tensor] = {}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: torch.Tensor | None = None) -> torch.Tensor:
    """Interleaved RoPE on the trailing `cos.shape[-1]` channels of x: pair (2i, 2i+1) rotates by angle i.

    x is [..., rows, (heads,) dim]; cos/sin are [rows, rope_dim] (already repeated per pair) and broadcast over
    the heads axis when x has one. Pass `-sin` for the inverse rotation. `rot` = rotate_half_matrix(rope_dim)
    (built and cached when not given)."""
    rd = cos.shape[-1]
    if rot is None:
        key = (rd, str(cos.device))
        if key not in _ROT:
            _ROT[key] = rotate_half_matrix(rd, cos.device)
        rot = _ROT[key]
    if x.dim() == cos.dim() + 1:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    rope = x[..., -rd:]
    if rope.dtype != torch.float32:
        rope = rope.float()
    rotated = rope * cos + torch.matmul(rope, rot) * sin
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)
