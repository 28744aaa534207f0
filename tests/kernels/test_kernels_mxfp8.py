"""MXFP8 quantizer, WO-A reduce+quantize and WO-B linear: Triton kernels (CPU interpreter) against the references."""

from __future__ import annotations

import pytest
import torch

from evalpipe.kernels.mxfp8 import (
    Mxfp8Tensor,
    mxfp8_linear,
    mxfp8_linear_reference,
    mxfp8_quantize,
    mxfp8_quantize_reference,
    mxfp8_reduce_quantize,
    mxfp8_reduce_quantize_reference,
    reduce_partials_bf16,
    scale_buffer_size,
    swizzled_scale_offsets,
    wo_a_mxfp8,
    wo_a_mxfp8_reference,
    wo_a_partials,
    wo_a_partials_reference,
    wo_a_split_bounds,
)

MAGNITUDES = [0.0, 1e-37, 1e-7, 1.0, 448.0, 1e10]


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bytes(a: Mxfp8Tensor, b: Mxfp8Tensor):
    assert torch.equal(u8(a.data), u8(b.data)), f"{(u8(a.data) != u8(b.data)).sum()} data bytes differ"
    assert torch.equal(a.scales, b.scales), f"{(a.scales != b.scales).sum()} scale bytes differ"


def magnitude_rows(rows: int, seed: int, splits: int = 0) -> torch.Tensor:
    """Each 32-group of a row gets one magnitude of MAGNITUDES (all six per row, rotated by row), random signs."""
    g = torch.Generator().manual_seed(seed)
    cols = 32 * len(MAGNITUDES) * 2
    shape = (splits, rows, cols) if splits else (rows, cols)
    x = torch.randn(*shape, generator=g)
    mags = torch.tensor([MAGNITUDES[(j + r) % len(MAGNITUDES)] for r in range(rows) for j in range(cols // 32)]).view(
        rows, cols // 32
    )
    return x * mags.repeat_interleave(32, dim=1)


# rows 1..128 launch the same grid (one 128-row scale tile of 16-row programs) and differ only in the rows masked
# off in it: 1, 3 and 8 (the production M 1..8) for those, 130 for a second scale tile
@pytest.mark.parametrize("rows", [1, 3, 8, 130])
def test_reduce_quantize_byte_exact(rows):
    """The fused WO-A tail equals reference reduce (s = 0..7) + bf16 + quantize, byte for byte, over all magnitudes."""
    partials = magnitude_rows(rows, seed=rows, splits=8)
    got = mxfp8_reduce_quantize(partials, backend="triton")
    assert_same_bytes(got, mxfp8_reduce_quantize_reference(partials))
    assert got.scales.shape == (scale_buffer_size(rows, partials.shape[2]),)


@pytest.mark.parametrize("rows,dtype", [(1, torch.float32), (6, torch.bfloat16), (257, torch.float32)])
def test_quantize_byte_exact(rows, dtype):
    y = magnitude_rows(rows, seed=40 + rows).to(dtype)
    assert_same_bytes(mxfp8_quantize(y, backend="triton"), mxfp8_quantize_reference(y))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_scale_padding_rewritten_to_zero(backend):
    """Buffers pre-filled with 255 (as after another graph replay): every padding scale byte comes back 0."""
    rows, cols = 5, 96  # 3 scale groups -> padded to 4 columns; 5 rows -> padded to 128
    out = Mxfp8Tensor.empty(rows, cols)
    for seed in range(2):  # a second call with new inputs into the same buffers
        out.scales.fill_(255)
        u8(out.data).fill_(255)
        y = magnitude_rows(rows, seed=seed)[:, :cols] + 1.0
        mxfp8_quantize(y, out=out, backend=backend)
        live = torch.zeros_like(out.scales, dtype=torch.bool)
        live[swizzled_scale_offsets(rows, cols)] = True
        assert out.scales[~live].eq(0).all() and (~live).sum() == 128 * 4 - rows * 3
        assert out.scales[live].ne(255).all()
        assert_same_bytes(out, mxfp8_quantize_reference(y))


def test_e8m0_and_e4m3_rounding_hand_checked():
    """Scale bytes and codes worked out by hand from the rule in the module docstring."""
    y = torch.zeros(1, 32 * 6)
    y[0, 0] = 448.0  # n = 1 exactly -> sf 127 (scale 1)
    y[0, 1], y[0, 2] = 1.0625, 1.1875  # ties at scale 1: 1.0625 -> 1.0 (0x38), 1.1875 -> 1.25 (0x3A)
    y[0, 32] = 449.0  # n just above 1 -> bumped to sf 128 (scale 2); 449/2 = 224.5 -> 224 (0x76)
    y[0, 64] = 1.0  # n = 2^-9 * 8/7 -> e 118 + bump = sf 119; 1 * 2^8 = 256 -> 0x78
    y[0, 96] = 448 * 2.0**-130  # n = 2^-130, subnormal with mantissa <= 0x400000 -> sf 0, flushed to 0
    y[0, 128] = 320 * 2.0**-126  # n = (5/7) 2^-126 subnormal, mantissa 0x5B6DB6 > 0x400000 -> sf 1; 320 (0x7A)
    y[0, 160] = -3e-3  # n = 1.755 * 2^-18 -> sf 110 (inv 2^17); -393.2 -> -384 = sign | 0x7C
    for q in (mxfp8_quantize(y, backend="triton"), mxfp8_quantize_reference(y)):
        assert q.scale_grid()[0].tolist() == [127, 128, 119, 0, 1, 110]
        codes = u8(q.data)[0]
        assert codes[[0, 1, 2, 32, 64, 96, 128, 160]].tolist() == [0x7E, 0x38, 0x3A, 0x76, 0x78, 0x00, 0x7A, 0xFC]
        assert q.dequantize()[0, 128].item() == y[0, 128].item()


@pytest.mark.parametrize("rows", [3, 130])
def test_dequantize_round_trip_bounds(rows):
    """|deq - y| <= half an e4m3 step: 2^-4 |y| for normal codes, 2^-10 * scale for subnormal ones; groups whose
    scale byte is 0 (amax < 448 * 2^-127 roughly) dequantize to 0."""
    g = torch.Generator().manual_seed(rows)
    y = torch.randn(rows, 256, generator=g) * torch.exp2(
        torch.randint(-40, 40, (rows, 8), generator=g).float()
    ).repeat_interleave(32, dim=1)
    q = mxfp8_quantize_reference(y)
    deq = q.dequantize()
    scale = torch.exp2(q.scale_grid().float() - 127).repeat_interleave(32, dim=1)
    assert (deq.abs() <= 448 * scale).all()
    err = (deq - y).abs()
    assert (err <= torch.maximum(y.abs() * 2.0**-4, scale * 2.0**-10)).all()
    assert mxfp8_quantize_reference(torch.full((1, 32), 1e-39)).dequantize().eq(0).all()


# rows 1 and 8: the M <= 16 tiles (one 16-row tile, mostly or half masked; 3 rows launched the same grid); 130:
# the 64-row tiles and several 128-row scale tiles
@pytest.mark.parametrize("rows", [1, 8, 130])
def test_wo_a_mxfp8(rows):
    """General G, R, Kg (Kg = 320: splits of 128, 128, 64 and five empty ones); x a strided view of a wider buffer."""
    g, r, kg = 2, 64, 320
    gen = torch.Generator().manual_seed(rows)
    attn = torch.randn(rows, 2 * g + 1, kg, generator=gen).bfloat16()  # padded attention output, 2 heads per group
    x = attn[:, 1 : 1 + 2 * g : 2]  # [M, G, Kg] view: stride(1) = 2 * Kg, unit last stride
    w_a = (torch.randn(g, r, kg, generator=gen) * kg**-0.5).bfloat16()
    assert [hi - lo for lo, hi in wo_a_split_bounds(kg)] == [128, 128, 64, 0, 0, 0, 0, 0]

    part = wo_a_partials(x, w_a, backend="triton")
    ref_part = wo_a_partials_reference(x, w_a)
    torch.testing.assert_close(part, ref_part, rtol=1e-5, atol=1e-5)
    fused = wo_a_mxfp8(x, w_a, backend="triton")
    assert_same_bytes(fused, mxfp8_reduce_quantize_reference(part))  # exact on the kernel's own partials

    ref = wo_a_mxfp8_reference(x, w_a)
    y_ref = reduce_partials_bf16(ref_part).float()
    # the reference WO-A is the grouped projection itself (bf16 output within one bf16 rounding of fp32 einsum)
    exact = torch.einsum("tgk,gnk->tgn", x.double(), w_a.double()).reshape(rows, -1)
    assert ((y_ref - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()
    scale = torch.exp2(ref.scale_grid().float() - 127).repeat_interleave(32, dim=1)
    assert ((fused.dequantize() - y_ref).abs() <= y_ref.abs() * 2.0**-3 + scale * 2.0**-9).all()


def test_wo_a_prefilled_out_and_guard():
    x = torch.randn(2, 2, 128).bfloat16()
    w_a = torch.randn(2, 32, 128).bfloat16()
    out = Mxfp8Tensor.empty(2, 64)
    out.scales.fill_(255)
    wo_a_mxfp8(x, w_a, out=out, backend="triton")
    assert_same_bytes(out, mxfp8_reduce_quantize_reference(wo_a_partials(x, w_a, backend="triton")))
    # fp32 activations fail the kernel's guard: auto uses the reference, forced triton says why
    assert_same_bytes(wo_a_mxfp8(x.float(), w_a.float()), wo_a_mxfp8_reference(x.float(), w_a.float()))
    with pytest.raises(ValueError, match="guard"):
        wo_a_mxfp8(x.float(), w_a.float(), backend="triton")


def test_mxfp8_linear_exact_when_sums_are_representable():
    """Small-integer activations and weights: every product and partial sum is exact in fp32, so the kernel's
    tile-order accumulation equals the reference bit for bit."""
    gen = torch.Generator().manual_seed(0)
    a_vals = torch.randint(-8, 9, (5, 128), generator=gen).float()
    a_vals[:, ::32] = 448.0  # pins every group's scale to 1, so the integers are stored exactly
    a = mxfp8_quantize_reference(a_vals)
    assert torch.equal(a.dequantize(), a_vals)
    w_b = torch.randint(-16, 17, (48, 128), generator=gen).bfloat16()
    got = mxfp8_linear(a, w_b, out_dtype=torch.float32, backend="triton")
    assert torch.equal(got, mxfp8_linear_reference(a, w_b, out_dtype=torch.float32))
    assert torch.equal(got, a_vals @ w_b.float().t())


@pytest.mark.parametrize("rows", [1, 17, 130])
def test_mxfp8_linear_matches_dequantized_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    k, n = 128, 80
    a = mxfp8_quantize_reference(torch.randn(rows, k, generator=gen) * 3)
    w_b = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    got = mxfp8_linear(a, w_b, out_dtype=torch.float32, backend="triton")
    ref = mxfp8_linear_reference(a, w_b, out_dtype=torch.float32)
    bound = k * 2.0**-24 * (a.dequantize().abs() @ w_b.float().abs().t())  # products exact, order may differ
    assert ((got - ref).abs() <= bound).all()
    bf16 = mxfp8_linear(a, w_b, backend="triton")
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), ref, rtol=2.0**-8, atol=1e-6)
    with pytest.raises(TypeError, match="Mxfp8Tensor"):
        mxfp8_linear((a.data, a.scales), w_b)  # a legacy (fp8, scale) tuple is not MXFP8


def test_dispatch_rules(monkeypatch):
    y = torch.randn(3, 64)
    ref = mxfp8_quantize_reference(y)
    assert_same_bytes(mxfp8_quantize(y, backend="reference"), ref)
    assert_same_bytes(mxfp8_quantize(y, backend="auto"), ref)  # CPU tensors: auto is the reference
    with pytest.raises(ValueError, match="N % 32"):
        mxfp8_quantize(torch.randn(3, 40))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        mxfp8_quantize(y, backend="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        wo_a_mxfp8(torch.randn(2, 2, 128).bfloat16(), torch.randn(2, 32, 128).bfloat16(), backend="triton")


@pytest.mark.parametrize("rows", [1, 16, 17])
def test_wo_a_single_launch_equals_two_launches(rows):
    """The one-kernel variant (last split of a column tile reduces + quantizes) writes the same bytes, rewrites the
    padding of a 255-filled buffer, and leaves its arrival tickets at 0 so the next call works; M > 16 falls back.
    M 1..16 run one 16-row tile (the same grid): 1 (mostly masked) and 16 (full) are its ends."""
    gen = torch.Generator().manual_seed(100 + rows)
    w_a = (torch.randn(2, 64, 256, generator=gen) / 16).bfloat16()
    out = Mxfp8Tensor.empty(rows, 128)
    for _ in range(2):
        x = torch.randn(rows, 2, 256, generator=gen).bfloat16()
        out.scales.fill_(255)
        u8(out.data).fill_(255)
        wo_a_mxfp8(x, w_a, out=out, backend="triton", single_launch=True)
        assert_same_bytes(out, wo_a_mxfp8(x, w_a, backend="triton", single_launch=False))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NaN/inf neighbours
def test_invariant_wo_projection_row_is_bitwise_the_same_in_any_batch():
    """`invariant=True` (--deterministic): WO-A + MXFP8 quantization + WO-B of one row are bitwise the same alone
    and at a random place among 2..64 rows of other random data (one NaN and one inf row among them), and
    equal the two-launch path's bytes on the row's own partials."""
    g, r, kg, n = 2, 64, 320, 80
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh inputs every run
    w_a = (torch.randn(g, r, kg, generator=gen) * kg**-0.5).bfloat16()
    w_b = (torch.randn(n, g * r, generator=gen) * 0.1).bfloat16()
    row = torch.randn(g, kg, generator=gen).bfloat16()

    def project(x):
        a = wo_a_mxfp8(x, w_a, backend="triton", invariant=True)
        return a, mxfp8_linear(a, w_b, backend="triton", invariant=True)

    a_alone, y_alone = project(row[None])
    assert_same_bytes(
        a_alone, mxfp8_reduce_quantize_reference(wo_a_partials(row[None], w_a, backend="triton", invariant=True))
    )
    for batch in (2, 17, 64):
        x = torch.randn(batch, g, kg, generator=gen).bfloat16()
        at = int(torch.randint(0, batch, (1,), generator=gen))
        x[(at + 1) % batch], x[(at + 2) % batch] = float("nan"), float("inf")
        x[at] = row
        a, y = project(x)
        assert torch.equal(u8(a.data)[at], u8(a_alone.data)[0]) and torch.equal(y[at], y_alone[0]), f"batch {batch}"
        assert torch.equal(a.scale_grid()[at], a_alone.scale_grid()[0])
