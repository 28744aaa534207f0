"""indexer_postprocess: the Triton kernel (interpreted on CPU) equals the PyTorch chain, which equals the spec."""

from __future__ import annotations

import math

import pytest
import torch

from evalpipe.kernels._backend import use_triton
from evalpipe.kernels.indexer_postprocess import indexer_postprocess, indexer_postprocess_reference

PAGE_SIZE = 64
POISON = 12345


def make_case(rows, width, k, index_dtype, seed):
    """Row-strided views sliced from wider buffers, with the production matrix's special scores."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, width + 7, generator=gen)[:, 3 : 3 + width]
    if rows > 0 and width > 0:
        scores[0, 0] = float("-inf")
    if rows > 1:
        scores[1, 0] = float("nan")
    if rows > 2:
        scores[2, 0] = float("inf")
    if rows > 3:
        scores[3, :] = float("-inf")
    indices = torch.randint(-2, width + 2, (rows, k + 5), generator=gen).to(index_dtype)[:, 2 : 2 + k]
    indices[:, : min(5, k)] = 0  # duplicates, and the special scores at column 0 are selected
    pages = max(1, math.ceil(width / PAGE_SIZE))
    physical = torch.stack([torch.randperm(4 * pages, generator=gen)[:pages] for _ in range(rows)]) if rows else None
    page_table = torch.zeros(rows, pages + 3, dtype=torch.int32)
    if rows:
        page_table[:, 1 : 1 + pages] = physical.to(torch.int32)
    return scores, indices, page_table[:, 1 : 1 + pages]


def spec_loop(scores, indices, page_table, page_size):
    """The pseudo-code of docs/kernels.md section 1a, one element at a time."""
    rows, k = indices.shape
    width = scores.shape[1]
    pages = torch.full((rows, k), -1, dtype=torch.int32)
    raw = torch.full((rows, k), -1, dtype=indices.dtype)
    for r in range(rows):
        for c in range(k):
            i = int(indices[r, c])
            inb = 0 <= i < width
            s = float(scores[r, i]) if inb else -math.inf
            if inb and s > -math.inf:
                pages[r, c] = int(page_table[r, i // page_size]) * page_size + i % page_size
                raw[r, c] = i
    return pages, raw


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_reference_matches_spec_pseudocode(index_dtype):
    scores, indices, page_table = make_case(6, 130, 40, index_dtype, seed=1)
    want_pages, want_raw = spec_loop(scores, indices, page_table, PAGE_SIZE)
    pages, raw = indexer_postprocess_reference(scores, indices, page_table, PAGE_SIZE, return_raw=True)
    assert torch.equal(pages, want_pages)
    assert torch.equal(raw, want_raw)
    assert raw.dtype == index_dtype
    # the special rows really are exercised: -inf and NaN invalid, +inf valid, all -inf row fully invalid
    assert pages[0, 0] == -1 and pages[1, 0] == -1 and pages[2, 0] != -1
    assert (pages[3] == -1).all()
    assert (pages[4] != -1).any() and (pages[4] == -1).any()


@pytest.mark.parametrize("rows", [1, 6, 64])
@pytest.mark.parametrize("width", [1, 65, 4096])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_matches_reference(rows, width, index_dtype):
    k = 300  # one full and one partial block of 256 lanes
    scores, indices, page_table = make_case(rows, width, k, index_dtype, seed=rows * 7 + width)
    for return_raw in (False, True):
        want = indexer_postprocess_reference(scores, indices, page_table, PAGE_SIZE, return_raw=return_raw)
        got = indexer_postprocess(scores, indices, page_table, PAGE_SIZE, return_raw=return_raw, backend="triton")
        assert torch.equal(got[0], want[0])
        assert got[0].dtype == torch.int32
        if return_raw:
            assert torch.equal(got[1], want[1]) and got[1].dtype == index_dtype
        else:
            assert got[1] is None and want[1] is None


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_kernel_rewrites_every_output_element_and_nothing_else(index_dtype):
    scores, indices, page_table = make_case(6, 200, 70, index_dtype, seed=3)
    page_buf = torch.full((6, 90), POISON, dtype=torch.int32)
    raw_buf = torch.full((6, 90), POISON, dtype=index_dtype)
    page_out, raw_out = page_buf[:, 10:80], raw_buf[:, 10:80]  # strided output views
    want = indexer_postprocess_reference(scores, indices, page_table, PAGE_SIZE, return_raw=True)
    got = indexer_postprocess(
        scores, indices, page_table, PAGE_SIZE, return_raw=True, page_out=page_out, raw_out=raw_out, backend="triton"
    )
    assert got[0].data_ptr() == page_out.data_ptr() and got[1].data_ptr() == raw_out.data_ptr()
    assert torch.equal(page_out, want[0]) and torch.equal(raw_out, want[1])
    assert not (page_out == POISON).any()
    assert (page_buf[:, :10] == POISON).all() and (page_buf[:, 80:] == POISON).all()
    assert (raw_buf[:, :10] == POISON).all() and (raw_buf[:, 80:] == POISON).all()


def test_kernel_index_columns_strided_and_out_of_range_both_ways():
    width = 100
    scores = torch.randn(3, width)
    base = torch.tensor([[-(2**31), -5, -1, 0, 99, 100, 2**31 - 1, 7]] * 3, dtype=torch.int64)
    wide = torch.zeros(3, 16, dtype=torch.int64)
    wide[:, ::2] = base
    indices = wide[:, ::2]  # non-unit column stride
    page_table = torch.arange(3 * 2, dtype=torch.int32).view(3, 2) + 10
    want = indexer_postprocess_reference(scores, indices, page_table, PAGE_SIZE, return_raw=True)
    got = indexer_postprocess(scores, indices, page_table, PAGE_SIZE, return_raw=True, backend="triton")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1][0].tolist() == [-1, -1, -1, 0, 99, -1, -1, 7]
    assert want[0][1, 4] == 13 * PAGE_SIZE + 99 % PAGE_SIZE


def test_empty_shapes():
    for rows, k in [(0, 8), (4, 0)]:
        scores, indices, page_table = make_case(rows, 65, k, torch.int32, seed=5)
        for backend in ("reference", "triton"):
            pages, raw = indexer_postprocess(scores, indices, page_table, PAGE_SIZE, return_raw=True, backend=backend)
            assert pages.shape == (rows, k) and raw.shape == (rows, k)


def test_dispatch_rules(monkeypatch):
    scores, indices, page_table = make_case(6, 65, 20, torch.int64, seed=9)
    want = indexer_postprocess_reference(scores, indices, page_table, PAGE_SIZE)
    # auto on CPU tensors picks the reference even with the interpreter on
    assert not use_triton("auto", [scores, indices, page_table], True)
    assert torch.equal(indexer_postprocess(scores, indices, page_table, PAGE_SIZE)[0], want[0])
    assert torch.equal(indexer_postprocess(scores, indices, page_table, PAGE_SIZE, backend="reference")[0], want[0])
    # a dtype outside the kernel's guard: auto falls back, a forced triton says why it cannot
    scores64 = scores.double()
    assert torch.equal(indexer_postprocess(scores64, indices, page_table, PAGE_SIZE)[0], want[0])
    with pytest.raises(ValueError, match="guard"):
        indexer_postprocess(scores64, indices, page_table, PAGE_SIZE, backend="triton")
    with pytest.raises(ValueError, match="backend must be"):
        indexer_postprocess(scores, indices, page_table, PAGE_SIZE, backend="cuda")
    with pytest.raises(ValueError, match="page_table covers"):
        indexer_postprocess(scores, indices, page_table[:, :1], PAGE_SIZE)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        indexer_postprocess(scores, indices, page_table, PAGE_SIZE, backend="triton")
