"""Candidate-block selection and token-mask publication for the two-level sparse indexer.

A *source* layer scores every compressed position, keeps the best `topk_blocks` blocks of `block_size` positions
and publishes a per-token keep mask; later *consumer* layers restrict their logits to that mask.

Source mode (published is None), per row r with L = clamp(lens[r], 0, W):
    masked[r, c] = logits[r, c] if c < L else -inf                          (fp32, returned)
    bscore[r, b] = max of masked over block b, NaN-propagating; a zero max is canonical +0.0
    if L > 0: bscore[r, (L - 1) // G] = +inf                                (the newest block is always kept)
    sel, val     = torch.topk(bscore[r], min(topk_blocks, nblocks), sorted=False)   (the library's tie rule)
    keep[r, :]   = False;  keep[r, b*G : min(b*G + G, W)] = (v > -inf) for each selected (b, v)
NaN-scored blocks can be selected (NaN ranks highest in topk) but are not kept; an all -inf row keeps only its newest
block; a row with L = 0 keeps nothing. Consumer mode: out[r, c] = logits[r, c] if c < L and published[r, c] else -inf.

Fused path: kernel 1 writes masked logits, clears keep and writes block scores (newest forced) in one pass;
torch.topk selects (same call as the reference, on bitwise-equal scores, so ties resolve identically); kernel 2
scatters the selected blocks and expands them to tokens. When topk_blocks >= nblocks every block is selected and
kernel 1 writes the final keep mask itself (score > -inf) -- the same result without a ranking. Consumer mode is one
kernel. All outputs are exactly
(equal_nan) the reference's. The -0.0 -> +0.0 canonicalisation matters because GPU topk ranks by float bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional on non-Linux hosts
    triton = None

TILE = 4096  # tokens per program (kernel 1 and consumer); kernel 2 handles TILE tokens of selected blocks
MAX_TRITON_BLOCK = 16384


def _check(logits, lens, topk_blocks, block_size, published):
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [R, W] tensor, got {logits.dtype}{tuple(logits.shape)}")
    if lens.dim() != 1 or lens.shape[0] != logits.shape[0] or lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lens must be int32/int64 [R={logits.shape[0]}], got {lens.dtype}{tuple(lens.shape)}")
    if block_size < 1 or topk_blocks < 1:
        raise ValueError(f"block_size and topk_blocks must be >= 1, got {block_size}, {topk_blocks}")
    if published is not None and (published.dtype != torch.bool or published.shape != logits.shape):
        raise ValueError(f"published must be bool {tuple(logits.shape)}, got {published.dtype}{tuple(published.shape)}")


def candidate_block_mask_reference(
    logits: torch.Tensor,
    lens: torch.Tensor,
    topk_blocks: int,
    block_size: int,
    published: torch.Tensor | None = None,
    *,
    masked_out: torch.Tensor | None = None,
    keep_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unfused torch chain (pad -> reshape -> max -> where -> topk -> scatter -> repeat_interleave)."""
    _check(logits, lens, topk_blocks, block_size, published)
    _check_outputs(logits, published, masked_out, keep_out)
    masked, keep = _reference_chain(logits, lens, topk_blocks, block_size, published)
    if masked_out is not None:
        masked = masked_out.copy_(masked)
    if keep_out is not None and keep is not None:
        keep = keep_out.copy_(keep)
    return masked, keep


def _check_outputs(logits, published, masked_out, keep_out):
    for name, buf, dtype in (("masked_out", masked_out, torch.float32), ("keep_out", keep_out, torch.bool)):
        if buf is not None and (buf.shape != logits.shape or buf.dtype != dtype or buf.device != logits.device):
            raise ValueError(
                f"{name} must be {dtype} {tuple(logits.shape)} on {logits.device}, got {buf.dtype}{tuple(buf.shape)}"
            )
    if keep_out is not None and published is not None:
        raise ValueError("keep_out is only written in source mode (published=None)")


def _reference_chain(logits, lens, topk_blocks, block_size, published):
    """The plain chain itself, on fresh tensors (the module docstring's pseudo-code, step by step)."""
    rows, width = logits.shape
    seq_len = lens.long().clamp(0, width)
    visible = torch.arange(width, device=logits.device)[None, :] < seq_len[:, None]
    if published is not None:
        return logits.float().masked_fill(~(visible & published), float("-inf")), None
    masked = logits.float().masked_fill(~visible, float("-inf"))
    nblocks = -(-width // block_size)
    if rows == 0 or width == 0:
        return masked, torch.zeros((rows, width), dtype=torch.bool, device=logits.device)
    padded = F.pad(masked, (0, nblocks * block_size - width), value=float("-inf"))
    bscore = padded.view(rows, nblocks, block_size).amax(dim=-1)
    bscore = torch.where(bscore == 0, torch.zeros_like(bscore), bscore)
    newest = (seq_len - 1).clamp(min=0) // block_size
    is_newest = (torch.arange(nblocks, device=logits.device)[None, :] == newest[:, None]) & (seq_len[:, None] > 0)
    bscore = bscore.masked_fill(is_newest, float("inf"))
    val, sel = torch.topk(bscore, min(topk_blocks, nblocks), dim=1, sorted=False)
    block_keep = torch.zeros((rows, nblocks), dtype=torch.bool, device=logits.device)
    block_keep.scatter_(1, sel, val > float("-inf"))
    keep = block_keep.repeat_interleave(block_size, dim=1, output_size=nblocks * block_size)[:, :width]
    return masked, keep


if triton is not None:

    def _mask_and_block_score_kernel(
        logits_ptr,
        lens_ptr,
        masked_ptr,
        keep_ptr,
        bscore_ptr,
        width,
        nblocks,
        block_size,
        l_row,
        l_col,
        m_row,
        k_row,
        b_row,
        ALL_SELECTED: tl.constexpr,
        BLOCKS: tl.constexpr,
        GP: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        blocks = tl.program_id(1).to(tl.int64) * BLOCKS + tl.arange(0, BLOCKS)
        inner = tl.arange(0, GP)
        seq_len = tl.minimum(tl.maximum(tl.load(lens_ptr + row).to(tl.int64), 0), width)
        cols = blocks[:, None] * block_size + inner[None, :]
        in_w = (inner[None, :] < block_size) & (cols < width)
        x = tl.load(logits_ptr + row * l_row + cols * l_col, mask=in_w, other=float("-inf")).to(tl.float32)
        m = tl.where(cols < seq_len, x, float("-inf"))
        tl.store(masked_ptr + row * m_row + cols, m, mask=in_w)
        is_nan = m != m
        has_nan = tl.max(is_nan.to(tl.int32), axis=1) > 0
        best = tl.max(tl.where(is_nan, float("-inf"), m), axis=1)
        score = tl.where(has_nan, float("nan"), best)
        score = tl.where(score == 0.0, 0.0, score)
        newest = (seq_len > 0) & (blocks == (seq_len - 1) // block_size)
        score = tl.where(newest, float("inf"), score)
        if ALL_SELECTED:
            # topk_blocks >= nblocks: topk returns every block, so keep is just "score > -inf" (NaN fails)
            kept = (score > float("-inf")).to(tl.uint8)
            tl.store(keep_ptr + row * k_row + cols, kept[:, None] + tl.zeros_like(cols).to(tl.uint8), mask=in_w)
        else:
            tl.store(keep_ptr + row * k_row + cols, tl.zeros_like(cols).to(tl.uint8), mask=in_w)
            tl.store(bscore_ptr + row * b_row + blocks, score, mask=blocks < nblocks)

    def _scatter_keep_kernel(
        sel_ptr,
        val_ptr,
        keep_ptr,
        width,
        k,
        block_size,
        s_row,
        v_row,
        k_row,
        SEL: tl.constexpr,
        GP: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        picks = tl.program_id(1).to(tl.int64) * SEL + tl.arange(0, SEL)
        in_k = picks < k
        block = tl.load(sel_ptr + row * s_row + picks, mask=in_k, other=0).to(tl.int64)
        val = tl.load(val_ptr + row * v_row + picks, mask=in_k, other=float("-inf"))
        kept = (val > float("-inf")).to(tl.uint8)
        inner = tl.arange(0, GP)
        cols = block[:, None] * block_size + inner[None, :]
        mask = in_k[:, None] & (inner[None, :] < block_size) & (cols < width)
        tl.store(keep_ptr + row * k_row + cols, kept[:, None] + tl.zeros_like(cols).to(tl.uint8), mask=mask)

    def _consumer_kernel(
        logits_ptr,
        lens_ptr,
        published_ptr,
        out_ptr,
        width,
        l_row,
        l_col,
        p_row,
        p_col,
        o_row,
        TILE_W: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * TILE_W + tl.arange(0, TILE_W)
        in_w = cols < width
        seq_len = tl.load(lens_ptr + row).to(tl.int64)
        x = tl.load(logits_ptr + row * l_row + cols * l_col, mask=in_w, other=float("-inf")).to(tl.float32)
        pub = tl.load(published_ptr + row * p_row + cols * p_col, mask=in_w, other=0)
        tl.store(out_ptr + row * o_row + cols, tl.where((cols < seq_len) & (pub != 0), x, float("-inf")), mask=in_w)


def _triton_guard(logits, lens, block_size, published, masked_out, keep_out) -> bool:
    tensors = [logits, lens] + ([published] if published is not None else [])
    outs = [t for t in (masked_out, keep_out) if t is not None]
    return (
        logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and block_size <= MAX_TRITON_BLOCK
        and all(t.device == logits.device for t in tensors)
        and all(t.stride(1) == 1 or t.shape[1] <= 1 for t in outs)
    )


def candidate_block_mask(
    logits: torch.Tensor,
    lens: torch.Tensor,
    topk_blocks: int,
    block_size: int,
    published: torch.Tensor | None = None,
    *,
    masked_out: torch.Tensor | None = None,
    keep_out: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Source mode: (masked fp32 logits [R, W], keep bool [R, W]); consumer mode: (restricted logits, None).

    logits:      [R, W] fp32 (bf16/fp16 accepted, widened exactly), any strides (production: row-strided).
    lens:        [R] int32 | int64 visible length per verify row (clamped to [0, W]).
    topk_blocks: blocks kept per row (production 2048); block_size: positions per block (production 8).
    published:   None (source mode) or the source layer's bool keep mask [R, W] (consumer mode), any strides.
    masked_out / keep_out: optional persistent fp32 / bool [R, W] buffers (unit column stride for the kernel);
    every element is rewritten on each call.
    Works up to W = 1,048,576. Exact (equal_nan) vs `candidate_block_mask_reference`; CUDA-graph safe.
    """
    _check(logits, lens, topk_blocks, block_size, published)
    _check_outputs(logits, published, masked_out, keep_out)
    guard = _triton_guard(logits, lens, block_size, published, masked_out, keep_out)
    tensors = [logits, lens] + ([published] if published is not None else [])
    if not use_triton(backend, tensors, guard):
        return candidate_block_mask_reference(
            logits, lens, topk_blocks, block_size, published, masked_out=masked_out, keep_out=keep_out
        )
    rows, width = logits.shape
    device = logits.device
    masked = masked_out if masked_out is not None else torch.empty((rows, width), dtype=torch.float32, device=device)
    if published is not None:
        _launch_consumer(logits, lens, published, masked)
        return masked, None
    keep = keep_out if keep_out is not None else torch.empty((rows, width), dtype=torch.bool, device=device)
    _launch_source(logits, lens, topk_blocks, block_size, masked, keep)
    return masked, keep


def _launch_consumer(logits, lens, published, masked) -> None:
    """Consumer mode: `masked` gets the logits where the published keep mask is set and the position is visible."""
    rows, width = logits.shape
    if rows and width:
        pub = published.view(torch.uint8)
        jit(_consumer_kernel)[(rows, triton.cdiv(width, TILE))](
            logits, lens, pub, masked, width, *logits.stride(), *pub.stride(), masked.stride(0), TILE_W=TILE
        )


def _launch_source(logits, lens, topk_blocks, block_size, masked, keep) -> None:
    """Source mode: `masked` gets the visible logits, `keep` the positions of each row's top `topk_blocks` blocks."""
    rows, width = logits.shape
    if rows == 0 or width == 0:
        keep.zero_()
        return
    nblocks = triton.cdiv(width, block_size)
    group = triton.next_power_of_2(block_size)
    per_program = max(1, TILE // group)
    all_selected = topk_blocks >= nblocks
    keep_bytes = keep.view(torch.uint8)
    bscore = _mask_and_score_blocks(logits, lens, masked, keep_bytes, nblocks, block_size, all_selected, per_program)
    if all_selected:  # every block is selected: no ranking needed, the single kernel wrote the final keep mask
        return
    _scatter_top_blocks(bscore, topk_blocks, keep_bytes, width, block_size, per_program)


def _mask_and_score_blocks(
    logits, lens, masked, keep_bytes, nblocks, block_size, all_selected, per_program
) -> torch.Tensor:
    """Writes the masked logits (and, when every block is selected, the keep mask); returns the block scores."""
    rows, width = logits.shape
    bscore = torch.empty((rows, 1 if all_selected else nblocks), dtype=torch.float32, device=logits.device)
    jit(_mask_and_block_score_kernel)[(rows, triton.cdiv(nblocks, per_program))](
        logits,
        lens,
        masked,
        keep_bytes,
        bscore,
        width,
        nblocks,
        block_size,
        *logits.stride(),
        masked.stride(0),
        keep_bytes.stride(0),
        bscore.stride(0),
        ALL_SELECTED=all_selected,
        BLOCKS=per_program,
        GP=triton.next_power_of_2(block_size),
    )
    return bscore


def _scatter_top_blocks(bscore, k, keep_bytes, width, block_size, per_program) -> None:
    """Sets `keep` over the positions of each row's k best-scoring blocks."""
    val, sel = torch.topk(bscore, k, dim=1, sorted=False)
    jit(_scatter_keep_kernel)[(sel.shape[0], triton.cdiv(k, per_program))](
        sel,
        val,
        keep_bytes,
        width,
        k,
        block_size,
        sel.stride(0),
        val.stride(0),
        keep_bytes.stride(0),
        SEL=per_program,
        GP=triton.next_power_of_2(block_size),
    )
