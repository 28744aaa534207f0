"""Q RoPE fused into the attention-buffer store: one pass that writes rotated q into the padded sparse-attention buffer.

Replaces "RoPE on q[..., D - rope_dim:] (the engine's `apply_interleaved_rope`), then copy q into the padded
[T, 64, D] buffer". `q` itself is left unchanged; heads of the padded buffer beyond H, and every byte of `out`'s
storage outside `out` (the view), are never written.

Exactness: bitwise equal to `out.copy_(apply_interleaved_rope(q, cos[positions], sin[positions]))`. The kernel
uses the op order of `evalpipe.kernels.rope` (separately rounded fp32 products, no FMA: it is launched with
`enable_fp_fusion=False`) and rounds once to out.dtype; the nope dims are stored from the loaded bits unchanged.
"""

from __future__ import annotations

import torch

from evalpipe.kernels._backend import jit, use_triton
from evalpipe.kernels.rope import apply_interleaved_rope

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional on non-Linux hosts
    triton = None

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check(q, out, cos, sin, positions):
    if q.dim() != 3 or out.shape != q.shape:
        raise ValueError(f"q must be [T, H, D] and out the same shape, got {tuple(q.shape)} and {tuple(out.shape)}")
    if q.dtype != out.dtype or q.dtype not in FLOAT_DTYPES:
        raise TypeError(f"q and out must share one of {FLOAT_DTYPES}, got {q.dtype} / {out.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(
            "cos and sin must be float32 [max_pos, rope_dim/2], "
            f"got {cos.dtype}{tuple(cos.shape)} / {sin.dtype}{tuple(sin.shape)}"
        )
    if positions.dim() != 1 or positions.shape[0] != q.shape[0] or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be int32/int64 [T={q.shape[0]}], got {positions.dtype}{tuple(positions.shape)}"
        )
    head_dim, rope_dim = q.shape[2], 2 * cos.shape[1]
    if rope_dim > head_dim or head_dim % 2:
        raise ValueError(f"rope_dim {rope_dim} must not exceed the even head_dim {head_dim}")


def q_rope_store_reference(
    q: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """The unfused chain: the engine's RoPE on a copy of q, then a copy into `out`. Same contract as `q_rope_store`."""
    _check(q, out, cos, sin, positions)
    pos = positions.long()
    rotated = apply_interleaved_rope(q, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    out.copy_(rotated)
    return out


if triton is not None:

    def round_fp32_to_bf16(x):
        """fp32 -> bf16 round-to-nearest-even done on the bits (NaN -> 0x7FC0).

        Same result as the GPU's cvt.rn.bf16.f32 and torch's `.to(torch.bfloat16)`; written out because Triton's
        CPU interpreter truncates on `.to(tl.bfloat16)`, which would make the interpreted tests meaningless.
        """
        u = x.to(tl.uint32, bitcast=True)
        u = u + (0x7FFF + ((u >> 16) & 1))
        u = tl.where(x != x, 0x7FC00000, u)
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    def _q_rope_store_kernel(
        q_ptr,
        out_ptr,
        cos_ptr,
        sin_ptr,
        pos_ptr,
        head_dim,
        nope_dim,
        q_tok,
        q_head,
        o_tok,
        o_head,
        c_row,
        OUT_BF16: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        tok = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        in_row = d < head_dim
        q_row = q_ptr + tok * q_tok + head * q_head
        x = tl.load(q_row + d, mask=in_row, other=0.0)
        is_rope = in_row & (d >= nope_dim)
        partner = tl.load(q_row + (d ^ 1), mask=is_rope, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        pair = (d - nope_dim) // 2
        c = tl.load(cos_ptr + pos * c_row + pair, mask=is_rope, other=0.0)
        s = tl.load(sin_ptr + pos * c_row + pair, mask=is_rope, other=0.0)
        xf = x.to(tl.float32)
        is_even = (d % 2) == 0
        # even lane e: e*c - o*s ; odd lane o: e*s + o*c  (partner is the other half of the pair)
        rotated = tl.where(is_even, xf * c - partner * s, partner * s + xf * c)
        if OUT_BF16:
            rounded = round_fp32_to_bf16(rotated)
        else:
            rounded = rotated.to(x.dtype)
        value = tl.where(is_rope, rounded, x)
        tl.store(out_ptr + tok * o_tok + head * o_head + d, value, mask=in_row)


# device functions the kernels call, in dependency order (kernels._backend.jit gives each kernel them jitted)
_HELPERS = (round_fp32_to_bf16,) if triton is not None else ()


def _triton_guard(q, out, cos, sin, positions) -> bool:
    return (
        q.stride(2) == 1
        and out.stride(2) == 1
        and cos.stride(1) == 1
        and sin.stride() == cos.stride()
        and q.device == out.device == cos.device == sin.device == positions.device
    )


def q_rope_store(
    q: torch.Tensor,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Write `q` with interleaved partial RoPE applied into `out` (a view of the padded attention buffer); return out.

    q:         [T, H, D] bf16 (fp16/fp32 accepted), unit stride on the last dim, any token/head strides.
    out:       [T, H, D] same dtype, unit last-dim stride: e.g. `buffer[:, :H]` of a padded [T, 64, D] buffer.
    cos, sin:  float32 [max_pos, rope_dim / 2] tables (`rope.rope_cos_sin` converts complex freqs_cis);
               rope dims are the trailing rope_dim dims of D, rotated as interleaved pairs (2i, 2i+1).
    positions: [T] int32 | int64, each in [0, max_pos) (not checked on device: that would need a host sync).
    Exact: bitwise equal to `q_rope_store_reference`. q unchanged. CUDA-graph safe (no host reads).
    """
    _check(q, out, cos, sin, positions)
    if not use_triton(backend, [q, out, cos, sin, positions], _triton_guard(q, out, cos, sin, positions)):
        return q_rope_store_reference(q, out, cos, sin, positions)
    tokens, heads, head_dim = q.shape
    if tokens == 0 or heads == 0:
        return out
    jit(_q_rope_store_kernel, helpers=_HELPERS)[(tokens, heads)](
        q,
        out,
        cos,
        sin,
        positions,
        head_dim,
        head_dim - 2 * cos.shape[1],
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK_D=triton.next_power_of_2(head_dim),
        enable_fp_fusion=False,
    )
    return out
