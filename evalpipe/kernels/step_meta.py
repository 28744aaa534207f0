"""Every index array of a static (CUDA-graph) step in one kernel, derived on the device from the step's input buffer.

A step's layers address state through a handful of integer arrays: each row's position and slot, its ring cell in
every ring (window, compressor and indexer rings), the pool rows of entries 0..E-1 of each request for every
compression ratio (through its page table), and for HCA the [T, E] rows with -1 where an entry is not yet visible.
Built with torch ops that is ~35 launches of 1-2 us integer kernels per step
(arange, mul, floor_divide, remainder, clamp, index, where, ...); here it is one launch. The results are integers,
so the kernel and the torch reference (the engine's own `entry_rows` arithmetic) agree exactly.

Layout of the input buffer (engine/static/batch.py, pack_step_inputs): ids [B*n] | starts [B] | slots [B] | row_valid
[B*n] |
page table [max_seqs, pages_per_seq]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from evalpipe.kernels._backend import jit, use_triton
from evalpipe.kernels.attention import hca_entry_rows

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None


@dataclass(frozen=True)
class MetaShape:
    """What the arrays depend on besides the buffer: batch shape, ring sizes, ratios and paging."""

    B: int
    n: int
    rings: tuple[int, ...]  # ring sizes, at most 3
    ratios: tuple[int, ...]  # compression ratios, at most 2
    entries: tuple[int, ...]  # fixed entry count per ratio (max_seq_len // ratio)
    hca_ratio: int  # 0: no [T, E] visible-rows array
    page_tokens: int
    pages_per_seq: int

    @property
    def T(self) -> int:
        return self.B * self.n


@dataclass
class StepMeta:
    pos: torch.Tensor  # [T] int64
    slot: torch.Tensor  # [T] int64
    cells: dict[int, torch.Tensor]  # ring size -> [T] ring cell (slot * R + pos % R)
    rows: dict[int, torch.Tensor]  # ratio -> [B, E] pool rows of entries 0..E-1
    hca_rows: torch.Tensor | None  # [T, E] rows of visible entries of the HCA ratio, -1 elsewhere


if tl is not None:

    def _step_meta_kernel(
        meta_ptr,
        out_ptr,
        T,
        B,
        n,
        page_tokens,
        P,
        E1,
        E2,
        off_rows1,
        off_rows2,
        off_hca,
        R1: tl.constexpr,
        R2: tl.constexpr,
        R3: tl.constexpr,
        Q1: tl.constexpr,
        Q2: tl.constexpr,
        HCA: tl.constexpr,
        N_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        j = tl.program_id(1)
        start = tl.load(meta_ptr + T + b)
        slot = tl.load(meta_ptr + T + B + b)
        pt = meta_ptr + 2 * T + 2 * B + slot * P
        i = tl.arange(0, N_PAD)
        im = i < n
        pos = start + i
        t = b * n + i
        if j == 0:  # the request's rows: position, slot, ring cells
            tl.store(out_ptr + t, pos, mask=im)
            tl.store(out_ptr + T + t, slot + i * 0, mask=im)
            tl.store(out_ptr + 2 * T + t, slot * R1 + pos % R1, mask=im)
            if R2 > 0:
                tl.store(out_ptr + 3 * T + t, slot * R2 + pos % R2, mask=im)
            if R3 > 0:
                tl.store(out_ptr + 4 * T + t, slot * R3 + pos % R3, mask=im)
        w = j * BLOCK + tl.arange(0, BLOCK)
        # entries 0..E-1 of this request per ratio: its page table row, as StatePools.entry_rows
        per1 = page_tokens // Q1
        m1 = w < E1
        page1 = tl.load(pt + tl.minimum((w * Q1) // page_tokens, P - 1), mask=m1, other=0)
        row1 = page1 * per1 + w % per1
        tl.store(out_ptr + off_rows1 + b * E1 + w, row1, mask=m1)
        if Q2 > 0:
            per2 = page_tokens // Q2
            m2 = w < E2
            page2 = tl.load(pt + tl.minimum((w * Q2) // page_tokens, P - 1), mask=m2, other=0)
            row2 = page2 * per2 + w % per2
            tl.store(out_ptr + off_rows2 + b * E2 + w, row2, mask=m2)
        if HCA > 0:  # [T, E] rows of the HCA ratio, -1 where entry w is not visible to row t
            if HCA == Q1:
                hrow, hm, he = row1, m1, E1
            else:
                hrow, hm, he = row2, m2, E2
            for r in range(0, n):
                vis = w < (start + r + 1) // HCA
                tl.store(out_ptr + off_hca + (b * n + r) * he + w, tl.where(vis, hrow, -1), mask=hm)


def step_meta_reference(meta: torch.Tensor, shape: MetaShape) -> StepMeta:
    """The torch chain (what StaticBatch computed before): the engine's entry-row arithmetic on device tensors."""
    B, n, T = shape.B, shape.n, shape.T
    starts, slots = meta[T : T + B], meta[T + B : T + 2 * B]
    table = meta[2 * T + 2 * B :].view(-1, shape.pages_per_seq)
    pos = (starts[:, None] + torch.arange(n, device=meta.device)[None]).reshape(-1)
    slot = slots[:, None].expand(B, n).reshape(-1)
    cells = {R: slot * R + pos % R for R in shape.rings}
    rows = {}
    for ratio, E in zip(shape.ratios, shape.entries):
        per_page = shape.page_tokens // ratio
        w = torch.arange(E, device=meta.device)[None].expand(B, E)
        col = ((w * ratio) // shape.page_tokens).clamp(max=shape.pages_per_seq - 1)
        rows[ratio] = table[slots[:, None], col] * per_page + w % per_page
    hca = hca_entry_rows(rows[shape.hca_ratio], pos, n, shape.hca_ratio) if shape.hca_ratio else None
    return StepMeta(pos, slot, cells, rows, hca)


def step_meta(meta: torch.Tensor, shape: MetaShape, *, backend: str = "auto") -> StepMeta:
    """All of a step's index arrays from its input buffer: one kernel on CUDA, the torch chain elsewhere."""
    ok = 1 <= len(shape.rings) <= 3 and 1 <= len(shape.ratios) <= 2 and meta.dtype == torch.int64
    if not ok or not use_triton(backend, [meta]):
        return step_meta_reference(meta, shape)
    B, n, T = shape.B, shape.n, shape.T
    E = list(shape.entries) + [0] * (2 - len(shape.entries))
    off_rows1 = 5 * T
    off_rows2 = off_rows1 + B * E[0]
    off_hca = off_rows2 + B * E[1]
    he = E[shape.ratios.index(shape.hca_ratio)] if shape.hca_ratio else 0
    out = torch.empty(off_hca + T * he, dtype=torch.int64, device=meta.device)
    rings = list(shape.rings) + [0] * (3 - len(shape.rings))
    ratios = list(shape.ratios) + [0] * (2 - len(shape.ratios))
    block = 1024
    grid = (B, max(1, triton.cdiv(max(E), block)))
    jit(_step_meta_kernel)[grid](
        meta,
        out,
        T,
        B,
        n,
        shape.page_tokens,
        shape.pages_per_seq,
        E[0],
        E[1],
        off_rows1,
        off_rows2,
        off_hca,
        R1=rings[0],
        R2=rings[1],
        R3=rings[2],
        Q1=ratios[0],
        Q2=ratios[1],
        HCA=shape.hca_ratio,
        N_PAD=triton.next_power_of_2(n),
        BLOCK=block,
        num_warps=4,
    )
    cells = {R: out[(2 + k) * T : (3 + k) * T] for k, R in enumerate(shape.rings)}
    rows = {
        q: out[(off_rows1, off_rows2)[k] : (off_rows1, off_rows2)[k] + B * E[k]].view(B, E[k])
        for k, q in enumerate(shape.ratios)
    }
    hca = out[off_hca : off_hca + T * he].view(T, he) if shape.hca_ratio else None
    return StepMeta(out[:T], out[T : 2 * T], cells, rows, hca)
