"""The whole CUDA-graph static step with every Triton kernel forced (Triton's CPU interpreter) against the plain
runner: the composition the H200 replays -- mHC merge/mix + pre_norm, q/kv norms, RoPE stores, C2 and window
compressors, indexer scores, the split-KV attention core, the MoE kernels -- float32, on a smaller random model
than the tiny one (tests/support/small_dsv4.py: one sliding, one CSA and one HCA layer, window 8, top-2
selection)."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.static.graphs import GraphRunner
from tests.support.engine_state import state_snapshot
from tests.support.small_dsv4 import TOPK, WINDOW, make_small_dsv4


def _prompt(n, seed):
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return str(make_small_dsv4(tmp_path_factory.mktemp("small-dsv4") / "model"))


# The served configuration only (the server always builds with sites): the bare runner's plain CSA selection
# runs the same kernels except candidate_block_mask/indexer_postprocess, each tested alone against its reference.
@pytest.mark.parametrize("sites", [True], ids=["served-csa-sites"])
def test_static_step_with_triton_kernels_equals_plain_runner(small_model, sites):
    """Two requests (bucket 2), one past the sliding window and the top-2 selection, one short: decode steps and
    one 6-row verify step give the plain runner's logits (fp32, different op grouping) and the same greedy tokens,
    and leave the same state behind. `served-csa-sites`: the model set up as the server sets it up
    (built with sites: CSA selection through candidate_block_mask + indexer_postprocess, Triton too)."""
    from evalpipe.engine.model import fused_sites

    assert (WINDOW, TOPK) == (8, 2)  # the prompt lengths below are chosen for these
    # 24 positions hold the longest history (12 + 1 + 6); the static step scans max_seq_len // ratio entries. A
    # rollback margin of 6 (the verify width) makes rings of 13 (window), 14 (CSA compressor and indexer) and 8
    # (HCA compressor) rows, which these short prompts wrap
    kw = dict(max_seqs=4, max_seq_len=24, rollback_margin=6)
    plain = ModelRunner(small_model, **kw)
    base = ModelRunner(small_model, **kw, sites=fused_sites.SiteSettings(backend="triton") if sites else None)
    graph = GraphRunner(base, widths=(1, 6), buckets=(2,), fused=True, kernel_backend="triton")
    seqs_p = [plain.allocate() for _ in range(2)]
    seqs_g = [graph.allocate() for _ in range(2)]
    last = []
    # The prefills run the eager Triton path row by row (much of this test's cost), so the prompts are as short as the
    # boundaries allow. Request 0, 12 tokens: its decode at position 12 has a full window that leaves positions
    # 0..4 out and sees 3 CSA entries (ratio 4), one more than the top-2 keeps; its verify (13..18) wraps the
    # CSA compressor's 14-row ring and starts on an odd (C2 ratio 2) position. Request 1, 5 tokens: a window that
    # starts before position 0, fewer entries than top-2 (empty picks), a verify (6..11) starting on an even one.
    # The graph runner prefills both in one forward (two groups, 17 rows: below 16 rows the mHC merge/mix kernel
    # would run 32-column blocks, more programs than 128-column ones); the plain runner one request at a time.
    prompts = [_prompt(n, i) for i, n in enumerate((12, 5))]
    for i, toks in enumerate(prompts):
        last.append(int(plain.forward([seqs_p[i]], [toks])[0].argmax()))
    graph.forward(seqs_g, prompts)
    calls = dict(fused_sites.site_counts())  # after the (eager) prefills: what follows is static steps only
    for step in range(3):  # decode, a 6-row verify with a rollback, decode from the rolled-back state
        if step == 1:
            rows = [[t] + _prompt(5, 50 + i) for i, t in enumerate(last)]
            a = plain.forward(seqs_p, rows, all_logits=True)
            b = graph.forward(seqs_g, rows, all_logits=True)
            keep = [3, 6]
            for sp, sg, k in zip(seqs_p, seqs_g, keep):
                base_len = plain.seq_len(sp) - 6
                plain.truncate(sp, base_len + k)
                graph.truncate(sg, base_len + k)
            picks = [a[i * 6 + k - 1] for i, k in enumerate(keep)]
        else:
            a = plain.forward(seqs_p, [[t] for t in last])
            b = graph.forward(seqs_g, [[t] for t in last])
            picks = list(a)
        assert torch.isfinite(b).all()
        assert (a - b).abs().max().item() < 1e-4, step
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        last = [int(r.argmax()) for r in picks]
    assert sorted(graph.steps) == [(2, 1), (2, 6)]
    if sites:  # the static step went through the sites (once per CSA layer and step)
        now = fused_sites.site_counts()
        assert now["indexer_postprocess"] > calls.get("indexer_postprocess", 0)
        assert now["candidate_block_mask"] > calls.get("candidate_block_mask", 0)
    for sp, sg in zip(seqs_p, seqs_g):
        snap_p, snap_g = state_snapshot(plain, sp), state_snapshot(graph, sg)
        for k in snap_p:
            assert (snap_p[k] - snap_g[k]).abs().max().item() < 1e-4, k
