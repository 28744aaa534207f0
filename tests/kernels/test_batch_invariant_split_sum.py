"""evalpipe/kernels/batch_invariant.py's `split_sum` (launch_matmul's sum of K slices, one Triton launch) in
Triton's CPU interpreter: bit for bit `split_sum_reference` (the torch formula: fp32 adds in slice order, bias,
`copy_`) on fresh random float32 partials of every kind (normal draws over six decades, raw bit patterns, +-0,
+-inf, NaN, subnormals) and on exact rounding ties of the output dtype, with and without a bias, into bfloat16,
float16 and float32, for 2 to 4 slices, odd shapes and strided views; a NaN only has to stay a NaN (torch's
own NaN bits differ between its code paths). Through launch_matmul: a split tile gives the bits of its slices
computed one by one and summed by the reference, in any output view and when the batch is launched in chunks."""

from __future__ import annotations

import random

import pytest
import torch

from evalpipe.kernels import batch_invariant as bi

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SPECIAL = (0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39)  # the last two: fp32 subnormals


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, why: str) -> None:
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{why}: NaN in other places"
    got_bits, want_bits = got[~nan].view(BITS[got.dtype]), want[~nan].view(BITS[want.dtype])
    assert torch.equal(got_bits, want_bits), f"{why}: {int((got_bits != want_bits).sum())} outputs differ"


def random_floats(shape, gen: torch.Generator) -> torch.Tensor:
    """float32 of every kind: 80% normal draws scaled by 1e-3..1e3, 12% raw bit patterns (huge, tiny, subnormal,
    inf and NaN payloads), 8% the SPECIAL values."""
    normal = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-3, 4, shape, generator=gen)
    raw = torch.randint(-(2**31), 2**31, shape, generator=gen).to(torch.int32).view(torch.float32)
    special = torch.tensor(SPECIAL)[torch.randint(0, len(SPECIAL), shape, generator=gen)]
    kind = torch.randint(0, 100, shape, generator=gen)
    return torch.where(kind < 80, normal, torch.where(kind < 92, raw, special))


def ties(shape, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """float32 values exactly halfway between two neighbours of `dtype` (bfloat16: low 16 bits 0x8000 under a
    random finite top half, subnormals included; float16: (k + 1/2) 2^e, normal and subnormal, up to the tie
    65520 that rounds to inf), random signs."""
    if dtype == torch.float16:
        k = torch.randint(1024, 2048, shape, generator=gen).double()
        e = torch.randint(-24, 6, shape, generator=gen).double()
        sub = torch.rand(shape, generator=gen) < 0.2
        k, e = torch.where(sub, k - 1024, k), torch.where(sub, -24.0, e)
        value = (k + 0.5) * 2.0**e
    else:
        top = torch.randint(0, 0x7F80, shape, generator=gen)  # exponent below 0xFF: finite
        value = ((top << 16) | 0x8000).to(torch.int32).view(torch.float32).double()
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return (sign * value).float()


def draw(gen: torch.Generator, dtype: torch.dtype, split: int, with_bias: bool):
    """Partials [B, split, M, N] and a bias [N] (or None); a quarter of the columns sum to ties of `dtype`
    exactly (the tie in slice 0, +-0 in the others, a +0 bias), and two other columns hold a NaN and an inf (in
    slice 0 of the first row, the other slices and the bias 0 there), so small draws still meet both."""
    B, M, N = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in ((1, 4), (1, 40), (4, 150)))
    parts = random_floats((B, split, M, N), gen)
    bias = random_floats((N,), gen).to(dtype) if with_bias else None
    order = torch.randperm(N, generator=gen)
    cols, (nan_col, inf_col) = order[: N // 4 + 1], order[N // 4 + 1 : N // 4 + 3].tolist()
    parts[:, 0, :, cols] = ties((B, M, len(cols)), dtype, gen)
    parts[:, 1:, :, cols] = torch.where(torch.rand((B, split - 1, M, len(cols)), generator=gen) < 0.5, -0.0, 0.0)
    for col, value in ((nan_col, float("nan")), (inf_col, float("-inf"))):
        parts[0, 0, 0, col], parts[0, 1:, 0, col] = value, 0.0
    if bias is not None:
        bias[cols] = 0.0
        bias[[nan_col, inf_col]] = 0.0
    return parts, bias


def poisoned(shape, dtype, poison: float, strided: bool) -> torch.Tensor:
    """An output filled with `poison`; strided: a view with no unit stride (every other column of a transpose)."""
    B, M, N = shape
    if strided:
        return torch.full((B, 2 * N, M), poison, dtype=dtype).transpose(1, 2)[:, :, ::2]
    return torch.full(shape, poison, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_sum_has_the_bits_of_the_torch_formula(dtype, split, with_bias):
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    parts, bias = draw(gen, dtype, split, with_bias)
    B, _, M, N = parts.shape
    want = bi.split_sum_reference(parts, bias, torch.empty(B, M, N, dtype=dtype))
    assert want.isnan().any() and want.isinf().any() and want.isfinite().any()
    for strided in (False, True):
        for poison in (float("nan"), 0.5):  # NaN catches a finite output left unwritten, 0.5 a NaN one
            out = poisoned((B, M, N), dtype, poison, strided)
            got = bi.split_sum(parts, bias, out, backend="triton")
            assert got is out
            assert_same_bits(out, want, f"seed {seed}, {B}x{M}x{N}, strided {strided}, poison {poison}")


def test_split_sum_rounds_ties_to_even_and_overflows_to_inf():
    """Hand-picked ties: bfloat16 1 + 2^-8 (down to 1), 1 + 3 2^-8 (up to 1 + 2^-6), the largest finite float32
    (up to inf); float16 2049 (down to 2048), 2051 (up to 2052), 65520 (up to inf), 2^-25 (down to 0)."""
    cases = {
        torch.bfloat16: ([1 + 2**-8, 1 + 3 * 2**-8, 3.4028234663852886e38], [1.0, 1 + 2**-6, float("inf")]),
        torch.float16: ([2049.0, 2051.0, 65520.0, 2.0**-25], [2048.0, 2052.0, float("inf"), 0.0]),
    }
    for dtype, (values, rounded) in cases.items():
        values = torch.tensor(values)
        parts = torch.stack([values, torch.zeros_like(values), -torch.zeros_like(values)])[None, :, None]
        out = bi.split_sum(parts, None, torch.full((1, 1, len(values)), float("nan"), dtype=dtype), backend="triton")
        assert out[0, 0].tolist() == rounded, dtype


def test_split_sum_sums_in_slice_order():
    """(2^24 + 1) + 1 rounds twice to 2^24 in float32; 2^24 + (1 + 1) would not: the slices are added in order.
    A bias adds after them, and strided partials are read where they are."""
    parts = torch.tensor([2.0**24, 1.0, 1.0, -(2.0**24)]).view(1, 4, 1, 1)
    one = bi.split_sum(parts, None, torch.empty(1, 1, 1), backend="triton")
    assert one.item() == 0.0 and bi.split_sum_reference(parts, None, torch.empty(1, 1, 1)).item() == 0.0
    wide = torch.randn(2, 3, 5, 14)[..., ::2]  # [2, 3, 5, 7], no unit stride
    bias = torch.randn(7)
    want = bi.split_sum_reference(wide, bias, torch.empty(2, 5, 7))
    assert torch.equal(bi.split_sum(wide, bias, torch.full((2, 5, 7), float("nan")), backend="triton"), want)


def test_split_sum_refuses_mismatched_shapes_and_dtypes():
    parts = torch.zeros(2, 3, 4, 5)
    with pytest.raises(ValueError, match="float32 parts"):
        bi.split_sum(parts.bfloat16(), None, torch.empty(2, 4, 5), backend="triton")
    with pytest.raises(ValueError, match="writes"):
        bi.split_sum(parts, None, torch.empty(2, 5, 4), backend="triton")
    with pytest.raises(ValueError, match="bias"):
        bi.split_sum(parts, torch.zeros(4), torch.empty(2, 4, 5), backend="triton")
    assert bi.split_sum(torch.zeros(2, 3, 0, 5), None, torch.empty(2, 0, 5), backend="triton").shape == (2, 0, 5)


def slices_one_by_one(a3, b3, bias, tile: bi.Tile, out_dtype) -> torch.Tensor:
    """The split product rebuilt by hand: each K slice (k_per long, launch_matmul's rule) an unsplit fp32 launch
    of the same K tiles in the same order, then the torch formula."""
    B, M, K = a3.shape
    N = b3.shape[2]
    k_per = -(-(-(-K // tile.split_k)) // tile.block_k) * tile.block_k
    parts = torch.empty(B, tile.split_k, M, N)
    for s in range(tile.split_k):
        lo, hi = s * k_per, min(K, (s + 1) * k_per)
        one = bi.Tile(block_n=tile.block_n, block_k=tile.block_k, split_k=1)
        bi.launch_matmul(a3[:, :, lo:hi], b3[:, lo:hi], parts[:, s], None, one)
    return bi.split_sum_reference(parts, bias, torch.empty(B, M, N, dtype=out_dtype))


@pytest.mark.parametrize("split", [2, 4])
def test_split_launch_is_its_slices_summed_by_the_torch_formula(split, monkeypatch):
    """launch_matmul with a split tile: the bits of its K slices launched one by one and summed by
    split_sum_reference, into a contiguous or a strided output, and with the batch launched in chunks (a
    MAX_GRID_Z of 5 programs: two batch entries per launch)."""
    seed = random.randrange(2**31)
    gen = torch.Generator().manual_seed(seed)
    B, M, N = 5, int(torch.randint(1, 70, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
    tile = bi.Tile(block_n=16, block_k=32, split_k=split)
    K = 32 * split * 2 + int(torch.randint(1, 32, (1,), generator=gen))  # every slice non-empty, the last short
    a3 = (torch.randn(B, M, K, generator=gen) * 4).bfloat16()
    b3 = torch.randn(B, N, K, generator=gen).bfloat16().transpose(1, 2)  # F.linear's layout, strided
    bias = torch.randn(N, generator=gen).bfloat16()
    want = slices_one_by_one(a3, b3, bias, tile, torch.bfloat16)
    for strided in (False, True):
        out = poisoned((B, M, N), torch.bfloat16, float("nan"), strided)
        bi.launch_matmul(a3, b3, out, bias, tile)
        assert_same_bits(out, want, f"seed {seed}, strided {strided}")
    monkeypatch.setattr(bi, "MAX_GRID_Z", 2 * split + 1)
    out = poisoned((B, M, N), torch.bfloat16, float("nan"), False)
    bi.launch_matmul(a3, b3, out, bias, tile)
    assert_same_bits(out, want, f"seed {seed}, chunked")
