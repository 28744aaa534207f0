"""The attention-input kernels of the CUDA-graph step (evalpipe/kernels/norm.py and indexer.py, rms_norm on
strided rows) in Triton's CPU interpreter, against their references and the engine's own ops."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.model import primitives
from evalpipe.kernels import norm
from evalpipe.kernels.indexer import indexer_scores, indexer_scores_reference
from evalpipe.kernels.norm import qkv_norm


@pytest.mark.parametrize("T", [1, 6])
def test_qkv_norm_on_gemm_column_slices(T):
    """q heads (gain-free) and the K=V head (with gain) from column slices of one projection, as StaticModel feeds
    them; equal to the engine's unweighted_rms_norm / rms_norm, every head written (poisoned buffer not used)."""
    gen = torch.Generator().manual_seed(T)
    H, D = 3, 40
    proj = 4 * torch.randn(T, H * D + 7 + D, generator=gen)
    proj[0, :D] = 0.0  # an all-zero head: finite (eps)
    q_src, kv_src = proj[:, 7 : 7 + H * D], proj[:, 7 + H * D :]
    w = 1 + 0.1 * torch.randn(D, generator=gen)
    got = qkv_norm(q_src, kv_src, w, H, 1e-6, backend="triton")
    assert got.shape == (T, H + 1, D) and torch.isfinite(got).all()
    want_q = primitives.unweighted_rms_norm(q_src.reshape(T, H, D), 1e-6)
    want_kv = primitives.rms_norm(kv_src, w, 1e-6)
    assert (got[:, :H] - want_q).abs().max().item() < 1e-5
    assert (got[:, H] - want_kv).abs().max().item() < 1e-5
    ref = qkv_norm(q_src, kv_src, w, H, 1e-6, backend="reference")
    assert (got - ref).abs().max().item() < 1e-5


def test_rms_norm_reads_a_column_slice_in_place():
    gen = torch.Generator().manual_seed(3)
    proj = torch.randn(5, 90, generator=gen)
    x = proj[:, 10:60]
    assert not x.is_contiguous()
    w = 1 + 0.1 * torch.randn(50, generator=gen)
    got = norm.rms_norm(x, w, 1e-6, backend="triton")
    assert got.is_contiguous() and (got - primitives.rms_norm(x.contiguous(), w, 1e-6)).abs().max().item() < 1e-5


def _engine_scores(q, wlog, entries, rows, pos, n, ratio, dim, heads):
    """The engine's Indexer.scores math written out (keys by pool row, fp32), masked as causal_topk masks."""
    B, E = rows.shape
    keys = entries[rows].float()
    s = torch.matmul(q.float().view(B, n, heads, dim), keys.transpose(1, 2).unsqueeze(1))
    s = torch.relu(s) * dim**-0.5
    s = (s * (wlog.float() * heads**-0.5).view(B, n, heads).unsqueeze(-1)).sum(dim=2).view(B * n, E)
    visible = torch.arange(E)[None] < ((pos + 1) // ratio)[:, None]
    return s.masked_fill(~visible, float("-inf"))


@pytest.mark.parametrize("n,E", [(1, 37), (6, 70), (6, 3)])
def test_indexer_scores_kernel(n, E):
    """Scores of entries read through pool rows (scattered pages), -inf exactly where an entry is not yet visible
    (positions near a ratio boundary, a request with no visible entry at all), for decode and 6-row verify."""
    gen = torch.Generator().manual_seed(n * 100 + E)
    B, H, d, ratio = 2, 16, 32, 4
    T = B * n
    pool = torch.randn(300, d, generator=gen)
    rows = torch.randperm(300, generator=gen)[: B * E].view(B, E)
    starts = torch.tensor([E * ratio - n - 1, 1])  # request 1: first positions, no visible entry for a while
    pos = (starts[:, None] + torch.arange(n)[None]).reshape(-1)
    q = torch.randn(T, H, d, generator=gen)
    wlog = torch.randn(T, H + 5, generator=gen)[:, 2 : 2 + H]  # strided view, as a GEMM column slice
    got = indexer_scores(q, wlog, pool, rows, pos, n, ratio, d**-0.5, H**-0.5, backend="triton")
    want = _engine_scores(q, wlog, pool, rows, pos, n, ratio, d, H)
    ref = indexer_scores_reference(q, wlog, pool, rows, pos, n, ratio, d**-0.5, H**-0.5)
    assert got.shape == (T, E)
    hidden = torch.isinf(want)
    assert torch.equal(torch.isinf(got), hidden) and torch.equal(torch.isinf(ref), hidden)
    assert hidden.any() and (~hidden).any()
    assert (got[~hidden] - want[~hidden]).abs().max().item() < 1e-4
    assert (ref[~hidden] - want[~hidden]).abs().max().item() < 1e-5


@pytest.mark.parametrize("n,E,k", [(1, 37, 8), (6, 70, 16), (6, 5, 5), (1, 300, 300)])
def test_csa_select_kernel_ranks_like_causal_topk(n, E, k):
    """Top-k pool rows by (score desc, index asc) with exact ties (many equal scores, +0.0 and -0.0, which the sort
    treats as equal), negative scores, NaN of either sign (first, as the sort ranks every NaN), and invisible (-inf)
    entries that become -1 -- equal to the reference and to the engine's causal_topk followed by the request's row
    lookup."""
    from evalpipe.engine.model.compressor import causal_topk
    from evalpipe.kernels.indexer import csa_select, csa_select_reference

    gen = torch.Generator().manual_seed(n * 1000 + E + k)
    B = 2
    T = B * n
    scores = torch.randn(T, E, generator=gen).round(decimals=1)  # plenty of exact ties
    scores[:, ::5] = 0.0
    scores[:, 1::7] = -0.0
    if E > 10:
        scores[0, 4], scores[0, 9] = float("nan"), -float("nan")
    counts = torch.randint(0, E + 1, (T,), generator=gen)
    counts[0] = E
    counts[-1] = 0 if E > 5 else 1  # a row with (almost) nothing visible
    visible = torch.arange(E)[None] < counts[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    rows = torch.randperm(4 * B * E, generator=gen)[: B * E].view(B, E)
    got = csa_select(scores, rows, n, k, backend="triton")
    ref = csa_select_reference(scores, rows, n, k)
    picked = causal_topk(scores.view(B, n, E), visible.view(B, n, E), k).view(T, k)
    b = torch.arange(T)[:, None] // n
    want = torch.where(picked >= 0, rows[b, picked.clamp(min=0)], torch.full_like(picked, -1))
    if k < E:
        assert torch.equal(ref, want)
    else:  # causal_topk keeps index order when k covers every entry; the set of rows is the same
        assert torch.equal(ref.sort(-1).values, want.sort(-1).values)
    assert torch.equal(got, ref)
