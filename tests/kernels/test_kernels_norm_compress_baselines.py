"""The benchmarks' baseline mHC / expert-GEMV kernels (tests/support/baseline_ops.py) and the static step's RMSNorm
and compressor-window kernels (evalpipe/kernels/norm.py, compress.py) in Triton's CPU interpreter against their
PyTorch references. Lives here for this directory's conftest, which turns the interpreter
on before Triton's language modules are imported."""

from __future__ import annotations

import pytest
import torch

from evalpipe.kernels import norm
from evalpipe.kernels.compress import compress
from tests.support import baseline_ops


@pytest.mark.parametrize("T", [1, 6])
def test_baseline_kernels_match_references(T):
    """The three Triton kernels, run in Triton's CPU interpreter, against their references (fresh random inputs,
    float32, non-power-of-two sizes to exercise the masks)."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(T)
    hc, D = 4, 200
    m = SimpleNamespace(
        fn=torch.randn(2 * hc + hc * hc, hc * D, generator=gen) / 10,
        base=0.5 * torch.randn(2 * hc + hc * hc, generator=gen),
        scale=1 + 0.1 * torch.randn(3, generator=gen),
        hc=hc,
        iters=20,
        eps=1e-6,
        norm_eps=1e-6,
    )
    s = torch.randn(T, hc, D, generator=gen)
    got = baseline_ops.hc_pre(m, s, backend="triton")
    ref = baseline_ops.hc_pre(m, s, backend="reference")
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all() and (g - r).abs().max().item() < 1e-5
    y = torch.randn(T, D, generator=gen)
    merged = baseline_ops.hc_merge(s, y, ref[0], ref[1], backend="triton")
    assert (merged - baseline_ops.hc_merge_reference(s, y, ref[0], ref[1])).abs().max().item() < 1e-5
    K = 3
    x = torch.randn(T, 300, generator=gen)
    W = torch.randn(7, 70, 300, generator=gen)
    idx = torch.randint(0, 7, (T * K,), generator=gen)
    scale = torch.rand(T * K, generator=gen)
    for sc in (None, scale):
        out = baseline_ops.expert_gemv(x, idx, W, sc, x_div=K, backend="triton")
        want = baseline_ops.expert_gemv_reference(x, idx, W, sc, x_div=K)
        assert out.shape == (T * K, 70) and (out - want).abs().max().item() < 1e-4


def test_expert_gemv_row_major_path_for_many_rows():
    """Past 64 picked rows the kernel switches from expert-major (tl.dot) to one program per row."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 96, generator=gen)
    W = torch.randn(5, 48, 96, generator=gen)
    idx = torch.randint(0, 5, (80,), generator=gen)
    scale = torch.rand(80, generator=gen)
    out = baseline_ops.expert_gemv(x, idx, W, scale, x_div=2, backend="triton")
    assert (out - baseline_ops.expert_gemv_reference(x, idx, W, scale, x_div=2)).abs().max().item() < 1e-4


@pytest.mark.parametrize("D", [64, 200])
def test_rms_norm_kernel_matches_engine_primitives(D):
    from evalpipe.engine.model import primitives

    gen = torch.Generator().manual_seed(D)
    x = 3 * torch.randn(7, 3, D, generator=gen)
    w = 1 + 0.1 * torch.randn(D, generator=gen)
    got = norm.rms_norm(x, w, 1e-6, backend="triton")
    assert (got - primitives.rms_norm(x, w, 1e-6)).abs().max().item() < 1e-5
    got = norm.rms_norm(x, None, 1e-6, backend="triton")
    assert (got - primitives.unweighted_rms_norm(x, 1e-6)).abs().max().item() < 1e-5


def test_compress_kernel_matches_engine_compressor(tiny_runner):
    """kernels.compress (one kernel) writes the same entries as the engine's Compressor.pool for every compressor
    of the tiny model (CSA overlap ratio 4, its indexer, HCA ratio 2), on a padded static step of two live
    requests whose rows complete windows, with ring (past) and in-forward rows both feeding the windows."""
    import dataclasses

    n = 6  # rows per request: windows complete inside the forward and straddle the ring (decode is the n=1 case)
    from evalpipe.engine.static.graphs import GraphRunner, StaticBatch, pack_step_inputs

    runner = tiny_runner(max_seqs=5, max_seq_len=160)
    graph = GraphRunner(runner, widths=(n,), buckets=(4,))
    gen = torch.Generator().manual_seed(n)
    seqs = [graph.allocate(), graph.allocate()]
    for s, length in zip(seqs, (43, 59)):
        graph.forward([s], [torch.randint(2, 500, (length,), generator=gen).tolist()])
    starts = [runner.seq_len(s) for s in seqs]
    runner.pools.reserve({s: st + n for s, st in zip(seqs, starts)})
    step = graph.step_for(2, n)
    toks = [[5] * n, [7] * n]
    step.meta.copy_(pack_step_inputs(toks, starts, seqs, step.B, graph.pad_slot, runner.pools.page_table))
    runner.pools._page_table_dev = step.page_table
    batch = StaticBatch(runner.pools, step.meta, step.B, n, step.consts)
    checked = 0
    for layer, pool in zip(runner.model.layers, runner.pools.layers):
        attn = layer.attn
        pairs = [(attn.compressor, pool.compressor)]
        if attn.indexer is not None:
            pairs.append((attn.indexer.compressor, pool.indexer))
        for comp, cpool in pairs:
            if comp is None:
                continue
            x = torch.randn(step.B * n, runner.config.hidden_size, generator=gen)
            proj = comp.project(x)
            ref = dataclasses.replace(cpool, ring=cpool.ring.clone(), entries=cpool.entries.clone())
            got = dataclasses.replace(cpool, ring=cpool.ring.clone(), entries=cpool.entries.clone())
            comp.pool(proj, batch, ref)
            compress(comp, proj, batch, got, backend="triton")
            trash = runner.pools.trash_page * runner.pools.page_tokens // comp.ratio
            live = slice(0, trash)  # the trash page collects padding windows in the reference only
            changed = (ref.entries[live] != cpool.entries[live]).any(dim=1).sum().item()
            assert changed >= 1
            assert (ref.entries[live] - got.entries[live]).abs().max().item() < 1e-5
            checked += 1
    assert checked >= 3
