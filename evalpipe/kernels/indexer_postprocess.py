"""Indexer post-processing: validate the top-k picks of the sparse indexer and map them to physical KV pages.

Replaces the unfused chain (gather the selected scores, build a validity mask, masked_fill -1, page-table gather,
`page * page_size + i % page_size`, where, optional raw copy) with one kernel launch.

Per row r and column c (column order preserved; no sorting, no compaction; duplicates passed through):
    i     = int64(indices[r, c]);  inb = 0 <= i < W
    s     = scores[r, i] if inb else -inf
    valid = inb and s > -inf                      # NaN fails the compare, +inf is valid
    page_indices[r, c] = page_table[r, i // page_size] * page_size + i % page_size  if valid else -1   (int32)
    raw[r, c]          = i if valid else -1                                                     (indices.dtype)
Exactness: integer outputs, equal (torch.equal) between the reference and the kernel.
"""

from __future__ import annotations

import torch

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional on non-Linux hosts
    triton = None

INDEX_DTYPES = (torch.int32, torch.int64)
PAGE_TABLE_DTYPES = (torch.int32, torch.int64)
BLOCK_K = 256


def _check(scores, indices, page_table, page_size):
    if scores.dim() != 2 or indices.dim() != 2 or page_table.dim() != 2:
        raise ValueError("scores [R, W], indices [R, K] and page_table [R, P] must all be 2-D")
    rows = scores.shape[0]
    if indices.shape[0] != rows or page_table.shape[0] != rows:
        raise ValueError(
            f"row counts differ: scores {rows}, indices {indices.shape[0]}, page_table {page_table.shape[0]}"
        )
    if indices.dtype not in INDEX_DTYPES:
        raise TypeError(f"indices must be int32 or int64, got {indices.dtype}")
    if page_table.dtype not in PAGE_TABLE_DTYPES:
        raise TypeError(f"page_table must be int32 or int64, got {page_table.dtype}")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be floating point, got {scores.dtype}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if page_table.shape[1] * page_size < scores.shape[1]:
        raise ValueError(
            f"page_table covers {page_table.shape[1]} pages x {page_size} = {page_table.shape[1] * page_size} "
            f"positions, fewer than W = {scores.shape[1]}"
        )


def _outputs(indices, return_raw, page_out, raw_out):
    rows, k = indices.shape
    if page_out is None:
        page_out = torch.empty((rows, k), dtype=torch.int32, device=indices.device)
    elif page_out.shape != indices.shape or page_out.dtype != torch.int32:
        raise ValueError(f"page_out must be int32 {tuple(indices.shape)}, got {page_out.dtype} {tuple(page_out.shape)}")
    if not return_raw:
        return page_out, None
    if raw_out is None:
        raw_out = torch.empty((rows, k), dtype=indices.dtype, device=indices.device)
    elif raw_out.shape != indices.shape or raw_out.dtype != indices.dtype:
        raise ValueError(
            f"raw_out must be {indices.dtype} {tuple(indices.shape)}, got {raw_out.dtype} {tuple(raw_out.shape)}"
        )
    return page_out, raw_out


def indexer_postprocess_reference(
    scores: torch.Tensor,
    indices: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    return_raw: bool = False,
    page_out: torch.Tensor | None = None,
    raw_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused PyTorch chain; same signature, shapes and results as `indexer_postprocess`."""
    _check(scores, indices, page_table, page_size)
    page_out, raw_out = _outputs(indices, return_raw, page_out, raw_out)
    width = scores.shape[1]
    idx = indices.long()
    in_bounds = (idx >= 0) & (idx < width)
    if width == 0 or idx.numel() == 0:
        valid = torch.zeros_like(in_bounds)
        safe = torch.zeros_like(idx)
        page_idx = safe
    else:
        safe = torch.where(in_bounds, idx, 0)
        selected = torch.gather(scores, 1, safe)
        selected = selected.masked_fill(~in_bounds, float("-inf"))
        valid = in_bounds & (selected > float("-inf"))
        pages = torch.gather(page_table, 1, torch.div(safe, page_size, rounding_mode="floor")).long()
        page_idx = pages * page_size + safe % page_size
    page_out.copy_(torch.where(valid, page_idx, -1).to(torch.int32))
    if raw_out is not None:
        raw_out.copy_(torch.where(valid, idx, -1).to(raw_out.dtype))
    return page_out, raw_out


if triton is not None:

    def _indexer_postprocess_kernel(
        scores_ptr,
        indices_ptr,
        page_table_ptr,
        page_out_ptr,
        raw_out_ptr,
        width,
        k,
        page_size,
        s_row,
        s_col,
        i_row,
        i_col,
        p_row,
        p_col,
        o_row,
        o_col,
        r_row,
        r_col,
        WRITE_RAW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_k = cols < k
        idx = tl.load(indices_ptr + row * i_row + cols * i_col, mask=in_k, other=-1).to(tl.int64)
        in_bounds = in_k & (idx >= 0) & (idx < width)
        score = tl.load(scores_ptr + row * s_row + idx * s_col, mask=in_bounds, other=float("-inf"))
        valid = in_bounds & (score > float("-inf"))
        page = tl.load(page_table_ptr + row * p_row + (idx // page_size) * p_col, mask=valid, other=0).to(tl.int64)
        page_idx = tl.where(valid, page * page_size + idx % page_size, -1)
        tl.store(page_out_ptr + row * o_row + cols * o_col, page_idx.to(tl.int32), mask=in_k)
        if WRITE_RAW:
            raw = tl.where(valid, idx, -1)
            tl.store(raw_out_ptr + row * r_row + cols * r_col, raw.to(raw_out_ptr.dtype.element_ty), mask=in_k)


def _triton_guard(scores, indices, page_table) -> bool:
    return (
        scores.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and scores.device == indices.device == page_table.device
    )


def indexer_postprocess(
    scores: torch.Tensor,
    indices: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    return_raw: bool = False,
    page_out: torch.Tensor | None = None,
    raw_out: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused score validation + invalid-index masking + logical-to-physical page mapping (+ raw index copy).

    scores:     [R, W] fp32 (bf16/fp16 accepted), any strides (production: row-strided, unit column stride).
    indices:    [R, K] int32 | int64 top-k logical positions; may hold -1, other negatives, or values >= W.
    page_table: [R, P] int32 | int64 with P * page_size >= W.
    page_out / raw_out: optional persistent output buffers (CUDA graphs); every element is rewritten each call.
    Returns (page_indices [R, K] int32, raw [R, K] indices.dtype or None). Page indices must fit in int32.
    Exact: integer results identical to `indexer_postprocess_reference`. CUDA-graph safe (no host reads).
    """
    _check(scores, indices, page_table, page_size)
    guard = _triton_guard(scores, indices, page_table)
    if not use_triton(backend, [scores, indices, page_table], guard):
        return indexer_postprocess_reference(
            scores, indices, page_table, page_size, return_raw=return_raw, page_out=page_out, raw_out=raw_out
        )
    page_out, raw_out = _outputs(indices, return_raw, page_out, raw_out)
    rows, k = indices.shape
    if rows == 0 or k == 0:
        return page_out, raw_out
    raw_arg = raw_out if raw_out is not None else page_out
    grid = (rows, triton.cdiv(k, BLOCK_K))
    jit(_indexer_postprocess_kernel)[grid](
        scores,
        indices,
        page_table,
        page_out,
        raw_arg,
        scores.shape[1],
        k,
        page_size,
        *scores.stride(),
        *indices.stride(),
        *page_table.stride(),
        *page_out.stride(),
        *raw_arg.stride(),
        WRITE_RAW=raw_out is not None,
        BLOCK=BLOCK_K,
    )
    return page_out, raw_out
