"""candidate_block_mask: the Triton kernels (interpreted on CPU) equal the torch chain, which follows the spec."""

from __future__ import annotations

import pytest
import torch

from evalpipe.kernels.candidate_block_mask import candidate_block_mask, candidate_block_mask_reference


def make_case(width, rows=6, seed=0, dtype=torch.float32):
    """The production matrix's rows: lens [0, 1, W/2, W-1, W, W]; row 3 ties, row 4 NaN at col 0, row 5 all -inf."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width + 5, generator=gen, dtype=dtype)[:, 2 : 2 + width]  # row-strided view
    all_lens = [0, 1, width // 2, width - 1, width, width]
    lens = torch.tensor(all_lens[:rows], dtype=torch.int32)
    if rows > 3:
        logits[3] = 0.0
    if rows > 4:
        logits[4, 0] = float("nan")
    if rows > 5:
        logits[5] = float("-inf")
    return logits, lens


def assert_same(got, want):
    assert got[0].dtype == torch.float32 and torch.equal(got[0].isnan(), want[0].isnan())
    assert torch.equal(got[0].nan_to_num(0.0, 1e38, -1e38), want[0].nan_to_num(0.0, 1e38, -1e38))
    if want[1] is None:
        assert got[1] is None
    else:
        assert got[1].dtype == torch.bool and torch.equal(got[1], want[1])


def kept_blocks(keep, block_size):
    rows, width = keep.shape
    nblocks = -(-width // block_size)
    padded = torch.nn.functional.pad(keep, (0, nblocks * block_size - width))
    return padded.view(rows, nblocks, block_size).any(-1)


def check_spec_properties(logits, lens, keep, topk_blocks, block_size):
    """What the spec promises, checked without the reference."""
    blocks = kept_blocks(keep, block_size)
    width = logits.shape[1]
    for r in range(logits.shape[0]):
        n = int(min(max(int(lens[r]), 0), width))
        assert int(blocks[r].sum()) <= min(topk_blocks, blocks.shape[1])
        if n == 0:
            assert not keep[r].any()
            continue
        assert blocks[r, (n - 1) // block_size]  # newest block always kept
        bl = blocks[r].repeat_interleave(block_size)[:width]
        assert torch.equal(keep[r], bl)  # whole blocks, final partial block included
    if logits.shape[0] > 5:
        assert int(blocks[5].sum()) == 1  # all -inf: only the newest block
        assert not blocks[4, 0] or int(lens[4]) <= block_size  # the NaN block is never kept (unless it is the newest)


# (W, G, topk) of the production matrix; the W = 1,048,576 cases run below with fewer kernel rows
MATRIX = [(65, 32, 8), (4096, 128, 8), (32768, 2048, 8), (4096, 8, 2048)]


@pytest.mark.parametrize("width,block_size,topk_blocks", MATRIX)
def test_source_and_consumer_kernels_match_reference(width, block_size, topk_blocks):
    logits, lens = make_case(width, seed=width + block_size)
    want = candidate_block_mask_reference(logits, lens, topk_blocks, block_size)
    check_spec_properties(logits, lens, want[1], topk_blocks, block_size)
    got = candidate_block_mask(logits, lens, topk_blocks, block_size, backend="triton")
    assert_same(got, want)
    # consumer mode with the published mask (a strided view of a wider buffer) and int64 lens
    wide = torch.zeros(logits.shape[0], width + 3, dtype=torch.bool)
    wide[:, 1 : 1 + width] = want[1]
    published = wide[:, 1 : 1 + width]
    lens64 = lens.long()
    want_c = candidate_block_mask_reference(logits, lens64, topk_blocks, block_size, published)
    got_c = candidate_block_mask(logits, lens64, topk_blocks, block_size, published, backend="triton")
    assert_same(got_c, want_c)
    expect = torch.where(want[1], want[0], torch.tensor(float("-inf")))  # consumer == source mask applied
    assert torch.equal(want_c[0].nan_to_num(0.0), expect.nan_to_num(0.0))


def test_million_wide_rows_production_budget():
    width = 1_048_576
    logits, lens = make_case(width, seed=3)
    for block_size, topk_blocks in [(2048, 8), (8, 2048)]:
        want = candidate_block_mask_reference(logits, lens, topk_blocks, block_size)
        check_spec_properties(logits, lens, want[1], topk_blocks, block_size)
        rows = [4] if block_size == 8 else [2]  # the interpreter is slow (~3 s per 1M row): one row through the kernel
        got = candidate_block_mask(logits[rows], lens[rows], topk_blocks, block_size, backend="triton")
        assert_same(got, (want[0][rows], want[1][rows]))
    assert int(want[1][2].sum()) == 2048 * 8  # the whole 16384-position budget is used when the row is long


def test_reference_follows_pseudocode_on_a_small_row():
    logits = torch.tensor([[1.0, 5.0, -2.0, float("nan"), 0.5, 3.0, -0.0, 0.0, 4.0, 2.0, 9.0]])
    lens = torch.tensor([10])  # col 10 (9.0) invisible
    masked, keep = candidate_block_mask_reference(logits, lens, topk_blocks=2, block_size=3)
    assert masked[0, 10] == float("-inf") and masked[0, 1] == 5.0
    # blocks: [1,5,-2]=5, [nan,.5,3]=nan, [-0,0,4]=4, [2,-inf]= newest -> +inf. topk 2 -> {nan, +inf}; NaN not kept
    assert keep[0].tolist() == [False] * 9 + [True, True]
    masked, keep = candidate_block_mask_reference(logits, lens, topk_blocks=3, block_size=3)
    assert keep[0].tolist() == [True] * 3 + [False] * 6 + [True] * 2


def test_ties_lengths_and_poison_free_outputs():
    # all-equal logits (ties resolved by topk identically), zero/negative/over-long lens, bf16 input widened exactly
    logits = torch.zeros(4, 300, dtype=torch.bfloat16)
    lens = torch.tensor([0, -3, 300, 1000], dtype=torch.int64)
    want = candidate_block_mask_reference(logits, lens, 5, 8)
    got = candidate_block_mask(logits, lens, 5, 8, backend="triton")
    assert_same(got, want)
    assert not want[1][:2].any() and int(kept_blocks(want[1], 8)[3].sum()) == 5
    # -0.0 block maxima are canonicalised to +0.0 before topk
    logits = torch.full((2, 64), -0.0)
    lens = torch.tensor([64, 30])
    assert_same(
        candidate_block_mask(logits, lens, 3, 8, backend="triton"), candidate_block_mask_reference(logits, lens, 3, 8)
    )


def test_persistent_output_buffers_fully_rewritten_and_nothing_else():
    logits, lens = make_case(203, seed=4)  # 26 blocks: topk 6 ranks them, topk 64 selects all of them
    cases = [(6, None), (64, None), (6, candidate_block_mask_reference(logits, lens, 6, 8)[1])]
    for topk, published in cases:
        want = candidate_block_mask_reference(logits, lens, topk, 8, published)
        masked_buf = torch.full((6, 211), 12345.0)
        keep_buf = torch.ones((6, 211), dtype=torch.bool)  # poison: everything "kept"
        masked_out, keep_out = masked_buf[:, 4:207], keep_buf[:, 4:207]  # row-strided views
        got = candidate_block_mask(
            logits,
            lens,
            topk,
            8,
            published,
            masked_out=masked_out,
            keep_out=keep_out if published is None else None,
            backend="triton",
        )
        assert got[0].data_ptr() == masked_out.data_ptr()
        assert_same((masked_out, keep_out if published is None else None), want)
        assert (masked_buf[:, :4] == 12345.0).all() and (masked_buf[:, 207:] == 12345.0).all()
        assert keep_buf[:, :4].all() and keep_buf[:, 207:].all()
        assert not (masked_out == 12345.0).any()


def test_empty_and_dispatch(monkeypatch):
    for shape in [(0, 64), (3, 0)]:
        logits = torch.randn(shape)
        lens = torch.zeros(shape[0], dtype=torch.int32)
        for backend in ("reference", "triton"):
            masked, keep = candidate_block_mask(logits, lens, 4, 8, backend=backend)
            assert masked.shape == shape and keep.shape == shape and not keep.any()
    logits, lens = make_case(100, seed=1)
    want = candidate_block_mask_reference(logits, lens, 4, 8)
    assert_same(candidate_block_mask(logits, lens, 4, 8), want)  # auto on CPU tensors is the reference
    assert_same(candidate_block_mask(logits.double(), lens, 4, 8), want)  # fp64 fails the guard: reference
    with pytest.raises(ValueError, match="guard"):
        candidate_block_mask(logits.double(), lens, 4, 8, backend="triton")
    with pytest.raises(ValueError, match="published"):
        candidate_block_mask(logits, lens, 4, 8, published=torch.ones(6, 100, dtype=torch.int32))
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        candidate_block_mask(logits, lens, 4, 8, backend="triton")
