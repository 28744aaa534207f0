"""evalpipe/kernels/batch_invariant.py in Triton's CPU interpreter: one row's output is bitwise the same alone and
at a random place among 2..64 rows of other random data (NaN and inf rows included), for random odd shapes in
float32 and bfloat16, and agrees with the PyTorch reference; the aten overrides come and go with `invariant_ops`."""

from __future__ import annotations

import pytest
import torch

from evalpipe.kernels import batch_invariant as bi

pytestmark = pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NaN/inf neighbours
BATCHES = (2, 3, 17, 64)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}
ROUNDING = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7}  # the output's rounding, relative


def _assert_matmul_close(out, a, b, bias=None):
    """out within the float32 accumulation error bound (1e-5 x sum |a||b|) plus the output's rounding of the
    reference (rows of any scale; rows with NaN/inf skipped)."""
    ref = bi.matmul_reference(a, b, bias).float()
    bound = torch.matmul(a.float().abs(), b.float().abs())
    ok = torch.isfinite(bound).all(-1)
    err = (out.float() - ref).abs()
    assert (err <= ROUNDING[a.dtype] * ref.abs() + 1e-5 * bound + 1e-6)[ok].all()


def _neighbours(batch: int, row: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """`batch` rows of fresh random data (scaled wildly, one NaN row and one inf row when there is room) with `row`
    at a random index; returns (rows, index)."""
    rows = (torch.randn(batch, *row.shape, generator=gen) * 10 ** torch.randint(-3, 4, (1,), generator=gen)).to(
        row.dtype
    )
    at = int(torch.randint(0, batch, (1,), generator=gen))
    others = [i for i in range(batch) if i != at]
    if len(others) >= 2:
        rows[others[0]] = float("nan")
        rows[others[1]] = float("inf")
    rows[at] = row
    return rows, at


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_matmul_row_is_bitwise_the_same_in_any_batch(dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    K, N = (int(v) for v in torch.randint(1, 150, (2,), generator=gen))
    weight = torch.randn(N, K, generator=gen).to(dtype)  # F.linear's layout: the kernel reads weight.t() strided
    bias = torch.randn(N, generator=gen).to(dtype) if seed else None
    row = torch.randn(K, generator=gen).to(dtype)
    alone = bi.matmul(row[None], weight.t(), bias, backend="triton")[0]
    torch.testing.assert_close(alone, bi.matmul_reference(row[None], weight.t(), bias)[0], **TOL[dtype])
    for batch in BATCHES:
        rows, at = _neighbours(batch, row, gen)
        out = bi.matmul(rows, weight.t(), bias, backend="triton")
        assert out.shape == (batch, N) and out.dtype == dtype
        assert torch.equal(out[at], alone), f"batch {batch}: row {at} changed"
        _assert_matmul_close(out, rows, weight.t(), bias)


def test_wide_matmul_tiles_keep_rows_invariant():
    """N >= WIDE_N (the LM head's 128-column tiles): a row alone equals the same row among 7 others."""
    gen = torch.Generator().manual_seed(8)
    K, N = 5, bi.WIDE_N + 3
    weight, row = torch.randn(N, K, generator=gen), torch.randn(K, generator=gen)
    alone = bi.matmul(row[None], weight.t(), backend="triton")[0]
    rows, at = _neighbours(7, row, gen)
    out = bi.matmul(rows, weight.t(), backend="triton")
    assert torch.equal(out[at], alone)
    _assert_matmul_close(out, rows, weight.t())


def test_tile_for_splits_deep_narrow_products_and_fits_shared_memory():
    """The sweep's rule: narrow N over deep K gets K slices (up to MAX_SPLIT), a wide product none; the pipelined
    tiles fit the shared memory given; nothing depends on M (tile_for does not take it)."""
    assert bi.tile_for(8, 4096).split_k == bi.MAX_SPLIT
    assert bi.tile_for(16384, 1024).split_k == 1 and bi.tile_for(32768, 4096).block_n == 128
    assert bi.tile_for(1024, 2048, batch=8).split_k == 1  # 8 batched weights fill the SMs without slices
    for n, k, size, smem in [(4096, 8192, 4, 100 * 1024), (32768, 4096, 4, 64 * 1024), (64, 64, 2, 32 * 1024)]:
        t = bi.tile_for(n, k, itemsize=size, smem=smem)
        assert bi.STAGES * (bi.BLOCK_M + t.block_n) * t.block_k * size <= smem


def test_matmul_split_by_tile_for_keeps_rows_invariant():
    """Through the public matmul, a product tile_for slices (N 8, K 600: 4 slices) keeps a row's bits in any batch."""
    gen = torch.Generator().manual_seed(21)
    K, N = 600, 8
    assert bi.tile_for(N, K).split_k > 1
    weight, row = torch.randn(N, K, generator=gen).bfloat16(), torch.randn(K, generator=gen).bfloat16()
    alone = bi.matmul(row[None], weight.t(), backend="triton")[0]
    for batch in (2, 64):
        rows, at = _neighbours(batch, row, gen)
        out = bi.matmul(rows, weight.t(), backend="triton")
        assert torch.equal(out[at], alone), f"batch {batch}: row {at} changed"
        _assert_matmul_close(out, rows, weight.t())


@pytest.mark.parametrize("split", [2, 3, 64])
def test_split_k_tiles_keep_rows_invariant(split):
    """A tile with K slices (summed in fp32 in slice order; 64 is more slices than K tiles): a row alone equals the
    same row among others, single and batched, with a bias, within the reference's bound."""
    gen = torch.Generator().manual_seed(split)
    K, N = int(torch.randint(130, 300, (1,), generator=gen)), int(torch.randint(1, 70, (1,), generator=gen))
    tile = bi.Tile(block_n=16, block_k=32, split_k=split)
    weight, bias = torch.randn(N, K, generator=gen).bfloat16(), torch.randn(N, generator=gen).bfloat16()
    row = torch.randn(2, K, generator=gen).bfloat16()  # two batch entries of one row each

    def product(a3):
        c3 = torch.full((a3.shape[0], a3.shape[1], N), float("nan"), dtype=a3.dtype)  # poisoned
        bi.launch_matmul(a3, weight.t().expand(a3.shape[0], K, N), c3, bias, tile)
        return c3

    alone = product(row[:, None])[:, 0]
    for batch in (2, 17):
        rows, at = _neighbours(batch, row, gen)  # [batch, 2, K]
        out = product(rows.transpose(0, 1).contiguous())
        assert torch.equal(out[:, at], alone), f"batch {batch}: row {at} changed"
        _assert_matmul_close(out, rows.transpose(0, 1), weight.t().expand(2, K, N), bias)


def test_batched_matmul_rows_are_invariant_and_match_reference():
    gen = torch.Generator().manual_seed(5)
    G, K, N = 3, 37, 20
    b = torch.randn(G, K, N, generator=gen)
    row = torch.randn(G, K, generator=gen)
    alone = bi.matmul(row[:, None], b, backend="triton")[:, 0]
    for batch in (2, 33):
        rows, at = _neighbours(batch, row, gen)  # [batch, G, K]
        out = bi.matmul(rows.transpose(0, 1), b, backend="triton")  # [G, batch, N], strided a
        assert torch.equal(out[:, at], alone)
        _assert_matmul_close(out, rows.transpose(0, 1), b)


def test_matmul_edges():
    a = torch.randn(4, 0)
    bias = torch.randn(3)
    assert torch.equal(bi.matmul(a, torch.randn(0, 3), bias, backend="triton"), bias.expand(4, 3))
    assert bi.matmul(torch.randn(0, 5), torch.randn(5, 3), backend="triton").shape == (0, 3)
    with pytest.raises(ValueError, match="do not fit"):
        bi.matmul(torch.randn(2, 5), torch.randn(4, 3), backend="triton")
    with pytest.raises(ValueError, match="one dtype"):
        bi.matmul(torch.randn(2, 5), torch.randn(5, 3).bfloat16(), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_reduction_is_bitwise_the_same_in_any_batch(dtype):
    gen = torch.Generator().manual_seed(11)
    L = 2 * bi.REDUCE_BLOCK + 77  # three blocks, the last partial
    row = torch.randn(L, generator=gen).to(dtype)
    for mean in (False, True):
        alone = bi.reduce_sum(row[None], -1, mean=mean, backend="triton")[0]
        torch.testing.assert_close(alone, bi.reduce_sum_reference(row[None], -1, mean=mean)[0], **TOL[dtype])
        for batch in BATCHES:
            rows, at = _neighbours(batch, row, gen)
            out = bi.reduce_sum(rows, [1], mean=mean, backend="triton")
            assert out.shape == (batch,) and out.dtype == dtype
            assert torch.equal(out[at], alone)
            assert out.isnan().sum() == (batch > 2)  # the NaN neighbour stays its own


def test_reduction_over_inner_dims_keepdim_dtype_and_integers():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 7, generator=gen)
    got = bi.reduce_sum(x, [0, 2], keepdim=True, backend="triton")
    assert got.shape == (1, 5, 1)
    torch.testing.assert_close(got, x.sum((0, 2), keepdim=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bi.reduce_sum(x, 1, mean=True, backend="triton"), x.mean(1), rtol=1e-6, atol=1e-6)
    got = bi.reduce_sum(x.bfloat16(), 2, dtype=torch.float32, backend="triton")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.bfloat16().float().sum(2), rtol=1e-5, atol=1e-5)
    flags = torch.rand(4, 9, generator=gen) < 0.5
    assert torch.equal(bi.reduce_sum(flags, 1, backend="triton"), flags.sum(1))
    ints = torch.randint(-(2**40), 2**40, (3, 6), generator=gen)
    assert torch.equal(bi.reduce_sum(ints, 0, backend="triton"), ints.sum(0))
    assert bi.reduce_sum(torch.randn(0, 4), 1, backend="triton").shape == (0,)
    with pytest.raises(ValueError, match="takes"):
        bi.reduce_sum(ints, 0, mean=True, backend="triton")


def _cuda_kernel_of(op: str) -> str:
    return next(line for line in torch._C._dispatch_dump_table(op).split("\n") if line.startswith("CUDA"))


def test_invariant_ops_overrides_cuda_kernels_only_while_open_and_nests():
    ops = ["aten::mm", "aten::addmm", "aten::bmm", "aten::sum.dim_IntList", "aten::mean.dim"]
    before = {op: _cuda_kernel_of(op) for op in ops}
    ours = "batch_invariant.py"
    with bi.invariant_ops():
        assert all(ours in _cuda_kernel_of(op) for op in ops)
        with bi.invariant_ops():
            assert ours in _cuda_kernel_of("aten::mm")
        assert ours in _cuda_kernel_of("aten::mm")  # the inner close keeps the outer registration
        x = torch.randn(3, 4)
        assert torch.equal(x @ torch.eye(4), x)  # CPU tensors keep torch's own kernels
    assert {op: _cuda_kernel_of(op) for op in ops} == before
    with bi.invariant_ops(enabled=False):
        assert _cuda_kernel_of("aten::mm") == before["aten::mm"]
    with pytest.raises(ValueError, match="gemm must be one of"):
        with bi.invariant_ops(gemm="cublas"):
            pass


def test_invariant_ops_leaves_mm_out_to_the_library_and_keeps_the_innermost_gemm_mode():
    """slab_matmul's products go through `mm.out`, which the overrides must leave alone (or it would call itself);
    the innermost open invariant_ops decides how mm and addmm run, and its close restores the outer one's."""

    def mm_out_kernel() -> str | None:  # None where this torch build has no CUDA kernels
        table = torch._C._dispatch_dump_table("aten::mm.out").split("\n")
        return next((line for line in table if line.startswith("CUDA")), None)

    mm_out = mm_out_kernel()
    with bi.invariant_ops(gemm="tiles"):
        assert _cuda_kernel_of("aten::mm").find("batch_invariant.py") > 0
        assert mm_out_kernel() == mm_out and "batch_invariant.py" not in (mm_out or "")
        assert bi._GEMM_MODES[-1] == "tiles"
        with bi.invariant_ops(gemm="slabs"):
            assert bi._GEMM_MODES[-1] == "slabs"
        assert bi._GEMM_MODES[-1] == "tiles"
    assert bi._GEMM_MODES == ["tiles"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 150])
def test_slab_matmul_pads_to_whole_slabs_and_keeps_rows_apart(dtype, rows):
    """Numbers only, on the CPU: each row within the accumulation bound of the reference, with and without bias.
    The claims of the same bits in any batch and of a NaN neighbour staying in its row are the library's on CUDA,
    checked there by tests/engine/test_engine_deterministic.py (a CPU BLAS may compute bfloat16 rows in pairs: on
    one build a NaN row spread to a second row)."""
    gen = torch.Generator().manual_seed(rows)
    a = torch.randn(rows, 300, generator=gen).to(dtype)
    w = torch.randn(300, 70, generator=gen).to(dtype)
    bias = torch.randn(70, generator=gen).to(dtype)
    out = bi.slab_matmul(a, w)
    assert out.shape == (rows, 70) and out.dtype == dtype
    _assert_matmul_close(out, a, w)
    _assert_matmul_close(bi.slab_matmul(a, w, bias), a, w, bias)
    view = torch.randn(rows, 301, generator=gen).to(dtype)[:, 1:]  # not contiguous: padded into a fresh copy
    _assert_matmul_close(bi.slab_matmul(view, w), view, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 63, 64, 65, 150])
def test_slab_bmm_pads_to_whole_slabs(dtype, rows):
    """Numbers only, on the CPU (the same bits in any batch are the library's claim on CUDA, checked by
    tests/engine/test_engine_deterministic.py): each row of each batch within the accumulation bound of the
    reference, for a contiguous a and for the decode step's transposed view of it."""
    gen = torch.Generator().manual_seed(rows + 7)
    w = torch.randn(3, 200, 40, generator=gen).to(dtype)
    a = torch.randn(3, rows, 200, generator=gen).to(dtype)
    out = bi.slab_bmm(a, w)
    assert out.shape == (3, rows, 40) and out.dtype == dtype
    _assert_matmul_close(out, a, w)
    view = torch.randn(rows, 3, 200, generator=gen).to(dtype).transpose(0, 1)  # [T, G, d] read as [G, T, d]
    _assert_matmul_close(bi.slab_bmm(view, w), view, w)
    with pytest.raises(ValueError, match="slab_bmm takes"):
        bi.slab_bmm(torch.randn(2, 5), torch.randn(5, 3))
    with pytest.raises(ValueError, match="do not fit"):
        bi.slab_bmm(torch.randn(2, 4, 5), torch.randn(3, 5, 3))


def test_slab_matmul_edges():
    assert bi.slab_matmul(torch.randn(0, 5), torch.randn(5, 3)).shape == (0, 3)
    assert torch.equal(bi.slab_matmul(torch.randn(2, 0), torch.randn(0, 3)), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="slab_matmul takes"):
        bi.slab_matmul(torch.randn(2, 2, 5), torch.randn(2, 5, 3))
    with pytest.raises(ValueError, match="do not fit"):
        bi.slab_matmul(torch.randn(2, 5), torch.randn(4, 3))
