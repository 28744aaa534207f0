"""graph_ops' Triton kernels (evalpipe/engine/graph_ops.py, used by the CUDA-graph static step) in Triton's CPU
interpreter against their PyTorch references. Lives here for this directory's conftest, which turns the interpreter
on before Triton's language modules are imported."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine import graph_ops


@pytest.mark.parametrize("T", [1, 6])
def test_graph_ops_triton_kernels_match_references(T):
    """The three Triton kernels, run in Triton's CPU interpreter, against their references (fresh random inputs,
    float32, non-power-of-two sizes to exercise the masks)."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(T)
    hc, D = 4, 200
    m = SimpleNamespace(fn=torch.randn(2 * hc + hc * hc, hc * D, generator=gen) / 10,
                        base=0.5 * torch.randn(2 * hc + hc * hc, generator=gen),
                        scale=1 + 0.1 * torch.randn(3, generator=gen), hc=hc, iters=20, eps=1e-6, norm_eps=1e-6)
    s = torch.randn(T, hc, D, generator=gen)
    got = graph_ops.hc_pre(m, s, backend="triton")
    ref = graph_ops.hc_pre(m, s, backend="reference")
    for g, r in zip(got, ref):
        assert torch.isfinite(g).all() and (g - r).abs().max().item() < 1e-5
    y = torch.randn(T, D, generator=gen)
    merged = graph_ops.hc_merge(s, y, ref[0], ref[1], backend="triton")
    assert (merged - graph_ops.hc_merge_reference(s, y, ref[0], ref[1])).abs().max().item() < 1e-5
    K = 3
    x = torch.randn(T, 300, generator=gen)
    W = torch.randn(7, 70, 300, generator=gen)
    idx = torch.randint(0, 7, (T * K,), generator=gen)
    scale = torch.rand(T * K, generator=gen)
    for sc in (None, scale):
        out = graph_ops.expert_gemv(x, idx, W, sc, x_div=K, backend="triton")
        want = graph_ops.expert_gemv_reference(x, idx, W, sc, x_div=K)
        assert out.shape == (T * K, 70) and (out - want).abs().max().item() < 1e-4


def test_expert_gemv_row_major_path_for_many_rows():
    """Past 64 picked rows the kernel switches from expert-major (tl.dot) to one program per row."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(40, 96, generator=gen)
    W = torch.randn(5, 48, 96, generator=gen)
    idx = torch.randint(0, 5, (80,), generator=gen)
    scale = torch.rand(80, generator=gen)
    out = graph_ops.expert_gemv(x, idx, W, scale, x_div=2, backend="triton")
    assert (out - graph_ops.expert_gemv_reference(x, idx, W, scale, x_div=2)).abs().max().item() < 1e-4


@pytest.mark.parametrize("D", [64, 200])
def test_rms_norm_kernel_matches_engine_primitives(D):
    from evalpipe.engine import primitives

    gen = torch.Generator().manual_seed(D)
    x = 3 * torch.randn(7, 3, D, generator=gen)
    w = 1 + 0.1 * torch.randn(D, generator=gen)
    got = graph_ops.rms_norm(x, w, 1e-6, backend="triton")
    assert (got - primitives.rms_norm(x, w, 1e-6)).abs().max().item() < 1e-5
    got = graph_ops.rms_norm(x, None, 1e-6, backend="triton")
    assert (got - primitives.unweighted_rms_norm(x, 1e-6)).abs().max().item() < 1e-5
