"""The one interleaved partial RoPE of the engine: the op order every RoPE user (model and fused kernels) shares.

DeepSeek-V4 rotates only the trailing `rope_dim` dims of each head, as interleaved pairs: dims
(D - rope_dim + 2i, D - rope_dim + 2i + 1) form the complex number e + i*o, multiplied by cos_i + i*sin_i.

Rounding points (the contract `q_rope_store` reproduces bit for bit):
  e, o  = fp32(x)                  exact for bf16/fp16 inputs
  e'    = (e*c) - (o*s)            each product rounded to fp32, then the difference rounded; no FMA
  o'    = (e*s) + (o*c)            same
  out   = x.dtype(e'), x.dtype(o') ONE rounding (round-to-nearest-even) at the end
The leading D - rope_dim dims are copied bit for bit. Because PyTorch evaluates every product and sum as its
own rounded op, a Triton kernel matches only when launched with `enable_fp_fusion=False` (no mul+add contraction);
for the same reason keep this function out of torch.compile, whose generated code may contract into FMAs.
`evalpipe.engine.model.primitives.apply_rope` (per-dim tables, cos[2i] == cos[2i+1]) computes the same products and
sums, so it gives the same bits; tests/kernels/test_kernels_q_rope.py checks that.
"""

from __future__ import annotations

import torch


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Return a new tensor: `x` with its trailing `2 * cos.shape[-1]` dims rotated as interleaved pairs.

    x:        [..., D] float (bf16 in the model); D - rope_dim leading dims are passed through unchanged.
    cos, sin: float32, broadcastable to x[..., : rope_dim // 2] (e.g. [T, 1, rope_dim // 2] for x [T, H, D]);
              normally rows of a `[max_pos, rope_dim // 2]` table gathered at the token positions.
    Exactness: fp32 math in the order given in the module docstring, one rounding to x.dtype.
    """
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError(f"cos/sin must be float32 tables, got {cos.dtype} / {sin.dtype}")
    half = cos.shape[-1]
    rope_dim = 2 * half
    head_dim = x.shape[-1]
    if rope_dim > head_dim:
        raise ValueError(f"rope_dim {rope_dim} exceeds the last dim {head_dim} of x")
    nope = head_dim - rope_dim
    pairs = x[..., nope:].float().unflatten(-1, (half, 2))
    e, o = pairs[..., 0], pairs[..., 1]
    new_e = (e * cos) - (o * sin)
    new_o = (e * sin) + (o * cos)
    rotated = torch.stack((new_e, new_o), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :nope], rotated), dim=-1)


def rope_cos_sin(freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a complex64 `freqs_cis [max_pos, rope_dim // 2]` table into contiguous fp32 (cos, sin) tables."""
    if not freqs_cis.is_complex():
        raise TypeError(f"freqs_cis must be complex, got {freqs_cis.dtype}")
    return freqs_cis.real.float().contiguous(), freqs_cis.imag.float().contiguous()
