"""q_rope_store and the shared RoPE helper: the Triton kernel (interpreted on CPU) is bitwise equal to RoPE + copy."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from evalpipe.kernels._backend import jit
from evalpipe.kernels.q_rope_store import q_rope_store, q_rope_store_reference, round_fp32_to_bf16
from evalpipe.kernels.rope import apply_interleaved_rope, rope_cos_sin

HEAD_DIM, ROPE_DIM, PADDED_HEADS, MAX_POS = 512, 64, 64, 4200
POISON = 7.0


def _round_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, round_fp32_to_bf16(x), mask=offs < n)


def tables(max_pos=MAX_POS, rope_dim=ROPE_DIM, theta=160000.0):
    inv = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    freqs_cis = torch.polar(
        torch.ones(max_pos, rope_dim // 2), torch.outer(torch.arange(max_pos).double(), inv).float()
    )
    return rope_cos_sin(freqs_cis)


COS, SIN = tables()


def bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def make_q(tokens, heads, seed, head_dim=HEAD_DIM, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    wide = (torch.randn(tokens, heads + 1, head_dim, generator=gen) * 4).to(dtype)
    return wide[:, 1:]  # a [T, H+1, D] slice: token stride (H+1)*D, head stride D


def test_apply_interleaved_rope_is_the_complex_rotation_of_the_trailing_dims():
    x = make_q(3, 2, seed=0)
    pos = torch.tensor([0, 5, 4100])
    y = apply_interleaved_rope(x, COS[pos].unsqueeze(1), SIN[pos].unsqueeze(1))
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(bits(y[..., :-ROPE_DIM]), bits(x[..., :-ROPE_DIM]))
    assert torch.equal(bits(y[0]), bits(x[0]))  # position 0 is the identity rotation
    freqs = torch.complex(COS[pos], SIN[pos]).unsqueeze(1).to(torch.complex128)
    exact = torch.view_as_real(
        torch.view_as_complex(x[..., -ROPE_DIM:].double().unflatten(-1, (-1, 2)).contiguous()) * freqs
    )
    err = (y[..., -ROPE_DIM:].double() - exact.flatten(-2)).abs()
    ulp = exact.flatten(-2).abs().clamp(min=1e-30) * 2.0**-8  # one bf16 rounding at the end
    assert (err <= ulp).all()
    assert not torch.equal(bits(y[1:, :, -ROPE_DIM:]), bits(x[1:, :, -ROPE_DIM:]))


# One program per (token, head), each on its own row: the token count only sizes the grid, the head count the
# strides (q is a [T, H + 1, D] slice, out a [T, 64, D] buffer's first H heads) and the positions' dtype the one
# load of a position, so each of T 1, 2, 5, 6, 8, H 8, 16, 32 and both dtypes appear, rather than their 30 products
I32, I64 = torch.int32, torch.int64


@pytest.mark.parametrize("tokens,heads,pos_dtype", [(1, 8, I32), (2, 32, I64), (5, 16, I32), (6, 8, I64), (8, 16, I64)])
def test_kernel_bitwise_equals_rope_then_copy(tokens, heads, pos_dtype):
    q = make_q(tokens, heads, seed=tokens * 100 + heads)
    q_before = q.clone()
    gen = torch.Generator().manual_seed(tokens + heads)
    positions = torch.randint(0, MAX_POS, (tokens,), generator=gen).to(pos_dtype)
    buffers = [torch.full((tokens, PADDED_HEADS, HEAD_DIM), POISON, dtype=torch.bfloat16) for _ in range(2)]
    want = q_rope_store_reference(q, buffers[0][:, :heads], COS, SIN, positions)
    got = q_rope_store(q, buffers[1][:, :heads], COS, SIN, positions, backend="triton")
    assert got.data_ptr() == buffers[1].data_ptr()
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(q), bits(q_before))
    assert (buffers[1][:, heads:] == POISON).all()
    # the reference really is "engine RoPE, then copy"
    engine = apply_interleaved_rope(q, COS[positions.long()].unsqueeze(1), SIN[positions.long()].unsqueeze(1))
    assert torch.equal(bits(want), bits(engine))


def test_kernel_production_positions_and_odd_shapes():
    # T = 6, H = 16 at positions 4096..4101 (the graph-replay case of the production tests)
    q = make_q(6, 16, seed=11)
    positions = torch.arange(4096, 4102, dtype=torch.int32)
    out_a = torch.full((6, PADDED_HEADS, HEAD_DIM), POISON, dtype=torch.bfloat16)
    out_b = out_a.clone()
    q_rope_store_reference(q, out_a[:, :16], COS, SIN, positions)
    q_rope_store(q, out_b[:, :16], COS, SIN, positions, backend="triton")
    assert torch.equal(bits(out_a), bits(out_b))
    # non-power-of-two head_dim, rope over the whole head, fp32 and fp16 buffers
    for head_dim, rope_dim, dtype in [(24, 8, torch.bfloat16), (16, 16, torch.float16), (40, 8, torch.float32)]:
        cos, sin = tables(64, rope_dim, theta=10000.0)
        q = make_q(3, 2, seed=head_dim, head_dim=head_dim, dtype=dtype)
        positions = torch.tensor([0, 17, 63])
        outs = [torch.full((3, 4, head_dim), POISON, dtype=dtype) for _ in range(2)]
        q_rope_store_reference(q, outs[0][:, 1:3], cos, sin, positions)
        q_rope_store(q, outs[1][:, 1:3], cos, sin, positions, backend="triton")
        assert torch.equal(bits(outs[0]), bits(outs[1]))
        assert (outs[1][:, 0] == POISON).all() and (outs[1][:, 3] == POISON).all()


def test_empty_and_dispatch(monkeypatch):
    q = make_q(0, 16, seed=0)
    out = torch.full((0, PADDED_HEADS, HEAD_DIM), POISON, dtype=torch.bfloat16)[:, :16]
    for backend in ("reference", "triton"):
        assert q_rope_store(q, out, COS, SIN, torch.zeros(0, dtype=torch.int64), backend=backend).shape == (0, 16, 512)
    q = make_q(2, 4, seed=1)
    positions = torch.tensor([3, 9])
    want = q_rope_store_reference(q, torch.empty_like(q), COS, SIN, positions)
    for backend in ("auto", "reference"):  # auto on CPU tensors is the reference
        assert torch.equal(bits(q_rope_store(q, torch.empty_like(q), COS, SIN, positions, backend=backend)), bits(want))
    q_cols = make_q(2, 4, seed=1).transpose(1, 2).contiguous().transpose(1, 2)  # last-dim stride != 1
    with pytest.raises(ValueError, match="guard"):
        q_rope_store(q_cols, torch.empty_like(q), COS, SIN, positions, backend="triton")
    with pytest.raises(ValueError, match="positions"):
        q_rope_store(q, torch.empty_like(q), COS, SIN, positions[:1])
    with pytest.raises(ValueError, match="float32"):
        q_rope_store(q, torch.empty_like(q), COS.double(), SIN.double(), positions)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        q_rope_store(q, torch.empty_like(q), COS, SIN, positions, backend="triton")


def test_bf16_rounding_helper_matches_torch_on_every_kind_of_float():
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int64).to(torch.int32)
    ties = (torch.arange(1 << 10, dtype=torch.int32) << 16) | 0x8000  # exactly halfway: even and odd neighbours
    specials = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 1.0, 3.3895314e38, 3.4028235e38, float("inf"), float("-inf")])
    x = torch.cat([random_bits.view(torch.float32), ties.view(torch.float32), specials])
    x = x[~torch.isnan(x)]
    y = torch.empty(x.shape, dtype=torch.bfloat16)
    jit(_round_kernel, helpers=(round_fp32_to_bf16,))[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def test_kernel_bitwise_equals_the_engines_own_rope_then_copy():
    """The contract against the real engine: evalpipe.engine.model.primitives.apply_rope (per-dim cos/sin tables)."""
    from evalpipe.engine.model.primitives import apply_rope

    cos_full, sin_full = COS.repeat_interleave(2, dim=-1) * 0.9, SIN.repeat_interleave(2, dim=-1) * 0.9  # YaRN-like
    q = make_q(6, 16, seed=21)
    positions = torch.tensor([4096, 4097, 4098, 4099, 4100, 4101])
    engine = apply_rope(q, cos_full[positions], sin_full[positions])
    out = torch.full((6, PADDED_HEADS, HEAD_DIM), POISON, dtype=torch.bfloat16)
    q_rope_store(
        q, out[:, :16], cos_full[:, ::2].contiguous(), sin_full[:, ::2].contiguous(), positions, backend="triton"
    )
    assert torch.equal(bits(out[:, :16]), bits(engine))
    assert not torch.equal(bits(engine), bits(q))
