"""step_meta: a static step's index arrays in one kernel (Triton's CPU interpreter) equal the torch chain exactly,
and the torch chain equals the engine's own StatePools.entry_rows / ring-cell arithmetic."""

from __future__ import annotations

import pytest
import torch

from evalpipe.kernels.step_meta import MetaShape, step_meta, step_meta_reference


def _buffer(B, n, max_seqs, pages_per_seq, gen):
    T = B * n
    ids = torch.randint(0, 500, (T,), generator=gen)
    starts = torch.randint(0, 300, (B,), generator=gen)
    if B > 1:
        starts[-1] = 0  # a padding-like request at position 0
    slots = torch.randperm(max_seqs, generator=gen)[:B]
    valid = torch.ones(T, dtype=torch.long)
    table = torch.randint(0, 50, (max_seqs, pages_per_seq), generator=gen)
    return torch.cat([ids, starts, slots, valid, table.reshape(-1)])


@pytest.mark.parametrize(
    "B,n,rings,ratios,hca",
    [
        (1, 1, (26, 30), (4, 2), 2),
        (3, 6, (26, 30, 34), (4, 2), 2),
        (2, 10, (40,), (4,), 0),
        (4, 3, (26, 30), (2, 4), 4),
    ],
)
def test_step_meta_kernel_equals_reference(B, n, rings, ratios, hca):
    gen = torch.Generator().manual_seed(B * 100 + n)
    page_tokens, pages_per_seq, max_seqs, max_seq_len = 16, 24, 6, 384
    meta = _buffer(B, n, max_seqs, pages_per_seq, gen)
    shape = MetaShape(
        B=B,
        n=n,
        rings=rings,
        ratios=ratios,
        entries=tuple(max_seq_len // r for r in ratios),
        hca_ratio=hca,
        page_tokens=page_tokens,
        pages_per_seq=pages_per_seq,
    )
    got = step_meta(meta, shape, backend="triton")
    ref = step_meta_reference(meta, shape)
    assert torch.equal(got.pos, ref.pos) and torch.equal(got.slot, ref.slot)
    for R in rings:
        assert torch.equal(got.cells[R], ref.cells[R])
    for r in ratios:
        assert torch.equal(got.rows[r], ref.rows[r])
    if hca:
        assert torch.equal(got.hca_rows, ref.hca_rows)
        assert (ref.hca_rows == -1).any() and (ref.hca_rows >= 0).any()
    else:
        assert got.hca_rows is None
    # the reference is the engine's own arithmetic: entry rows through the page table, ring cells by position
    T = B * n
    starts, slots = meta[T : T + B], meta[T + B : T + 2 * B]
    table = meta[2 * T + 2 * B :].view(max_seqs, pages_per_seq)
    for r in ratios:
        per = page_tokens // r
        for b in range(B):
            for w in (0, 1, shape.entries[ratios.index(r)] - 1):
                page = table[slots[b], min(w * r // page_tokens, pages_per_seq - 1)]
                assert ref.rows[r][b, w].item() == page.item() * per + w % per
    t = T - 1
    assert ref.pos[t].item() == starts[-1].item() + n - 1
    assert ref.cells[rings[0]][t].item() == slots[-1].item() * rings[0] + ref.pos[t].item() % rings[0]
