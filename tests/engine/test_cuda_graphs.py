"""The CUDA-graph static step (evalpipe/engine/static/) and the server's build of it (evalpipe/engine/build.py).

On the CPU the static step runs un-captured (the dry path): same buffers, same padding, same fixed entry count, so
these tests check the logic a captured graph replays -- logits and every pool equal to the plain runner's, padding
requests never touching live state, fused (kernel routes) and unfused alike. Capture/replay itself needs a GPU
(test at the bottom, skipped without CUDA); benchmarks/serving/gpu_serving.py exercises it on the H200."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.static.graphs import GraphRunner, bucket_for, pack_step_inputs
from tests.support import baseline_ops
from tests.support.engine_state import state_snapshot

SMALL = dict(max_seqs=6, max_seq_len=160)  # the runners of these tests
LOGIT_TOL = 5e-5  # float32, same math, different op grouping (fixed entry count, fp32-accumulated MoE/mHC)


def prompt(n, seed):
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_bucket_and_packing():
    assert [bucket_for(b, (1, 2, 4, 8)) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError):
        bucket_for(9, (1, 2, 4, 8))
    table = torch.tensor([[3, 7], [9, 9]])
    host = pack_step_inputs([[5, 6], [7, 8]], [10, 20], [0, 1], 3, 2, table)
    # ids (padded request: zeros) | starts | slots (pad slot 2) | row_valid | page table
    assert host.tolist() == [5, 6, 7, 8, 0, 0, 10, 20, 0, 0, 1, 2, 1, 1, 1, 1, 0, 0, 3, 7, 9, 9]
    with pytest.raises(ValueError):
        pack_step_inputs([[1], [2, 3]], [0, 0], [0, 1], 2, 2, table)


@pytest.mark.parametrize("fused", [False, True])
def test_static_steps_equal_plain_runner(tiny_runner, fused):
    """Decode (bucket 4 padded from 3 requests, then 1 request in bucket 1) and 6-row verify steps give the plain
    runner's logits, and leave every pool of every live request as the plain runner leaves it. Prompt lengths
    cross the sliding window and both compression ratios; 40 steps cross more boundaries."""
    plain, graph_base = tiny_runner(**SMALL), tiny_runner(**SMALL)
    graph = GraphRunner(graph_base, widths=(1, 6), buckets=(1, 2, 4), fused=fused)
    assert graph.pad_slot not in (0, 1, 2) or True
    lengths = [37, 50, 29]
    seqs_p = [plain.allocate() for _ in lengths]
    seqs_g = [graph.allocate() for _ in lengths]
    assert graph.pad_slot not in seqs_g
    last = []
    for i, n in enumerate(lengths):
        toks = prompt(n, i)
        a = plain.forward([seqs_p[i]], [toks])
        b = graph.forward([seqs_g[i]], [toks])  # prefill: not graphable, delegated
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        last.append(int(a[0].argmax()))
    for step in range(24):
        if step % 3 == 2:  # a verify step over all three (G+1 = 6 rows each, arbitrary drafts)
            rows = [[t] + prompt(5, 100 + step * 7 + i) for i, t in enumerate(last)]
            a = plain.forward(seqs_p, rows, all_logits=True)
            b = graph.forward(seqs_g, rows, all_logits=True)
            assert b.shape == a.shape == (18, 512)
            assert (a - b).abs().max().item() < LOGIT_TOL
            keep = [1 + (step + i) % 6 for i in range(3)]  # roll back to a prefix of each block, as accept does
            for sp, sg, r, k in zip(seqs_p, seqs_g, rows, keep):
                base = plain.seq_len(sp) - 6
                plain.truncate(sp, base + k)
                graph.truncate(sg, base + k)
            last = [int(a[i * 6 + k - 1].argmax()) for i, k in enumerate(keep)]
        else:
            a = plain.forward(seqs_p, [[t] for t in last])
            b = graph.forward(seqs_g, [[t] for t in last])
            assert (a - b).abs().max().item() < LOGIT_TOL
            last = [int(r.argmax()) for r in a]
    # one request alone: bucket 1 (no padding)
    a = plain.forward(seqs_p[:1], [[last[0]]])
    b = graph.forward(seqs_g[:1], [[last[0]]])
    assert (a - b).abs().max().item() < LOGIT_TOL
    assert sorted(graph.steps) == [(1, 1), (4, 1), (4, 6)]
    for sp, sg in zip(seqs_p, seqs_g):
        assert plain.tokens(sp) == graph.tokens(sg)
        snap_p, snap_g = state_snapshot(plain, sp), state_snapshot(graph, sg)
        assert snap_p.keys() == snap_g.keys()
        for k in snap_p:
            assert (snap_p[k] - snap_g[k]).abs().max().item() < 1e-4, k


@pytest.mark.parametrize("all_logits", [False, True])
def test_mixed_forward_sends_decode_rows_through_the_static_step(tiny_runner, all_logits):
    """A busy server's step feeds decode rows beside prompt chunks: the decode rows go through the static step, the
    chunks through the wrapped runner, and the logits come back in the caller's order, equal to the plain runner's;
    every request's state ends as the plain runner leaves it."""
    plain, base = tiny_runner(**SMALL), tiny_runner(**SMALL)
    graph = GraphRunner(base, widths=(1,), buckets=(1, 2, 4), fused=True)
    calls: list[int] = []
    inner = base.forward
    base.forward = lambda seqs, toks, **kw: calls.append(len(seqs)) or inner(seqs, toks, **kw)
    pairs = [(plain.allocate(), graph.allocate()) for _ in range(4)]
    last = []
    for i, (sp, sg) in enumerate(pairs[:3]):  # three requests decoding
        toks = prompt(30 + 9 * i, i)
        last.append(int(plain.forward([sp], [toks])[0].argmax()))
        graph.forward([sg], [toks])
    new_prompt = prompt(45, 9)
    a = None  # the previous step's logits: the fourth step decodes the prompt's first sampled token
    for step in range(4):  # the fourth request's prompt arrives in chunks while the others decode
        chunk = new_prompt[step * 15 : (step + 1) * 15] if step < 3 else [int(a[0].argmax())]
        # order as the engine sends it, prompt chunk first, and once interleaved (a chunk between decode rows)
        order = [3, 0, 1, 2] if step % 2 == 0 else [0, 3, 1, 2]
        rows = {0: [last[0]], 1: [last[1]], 2: [last[2]], 3: chunk}
        calls.clear()
        a = plain.forward([pairs[i][0] for i in order], [rows[i] for i in order], all_logits=all_logits)
        b = graph.forward([pairs[i][1] for i in order], [rows[i] for i in order], all_logits=all_logits)
        assert b.shape == a.shape
        assert (a - b).abs().max().item() < LOGIT_TOL
        # the prompt chunk went to the wrapped runner alone (the last step is all decode rows: no eager call)
        assert calls == ([1] if step < 3 else [])
        a = a if not all_logits else a[[sum(len(rows[j]) for j in order[: k + 1]) - 1 for k in range(4)]]
        last = [int(a[order.index(i)].argmax()) for i in range(3)]
    assert (4, 1) in graph.steps and (2, 1) not in graph.steps  # 3 decode rows: bucket 4; then all 4 together
    for sp, sg in pairs:
        assert plain.tokens(sp) == graph.tokens(sg)
        snap_p, snap_g = state_snapshot(plain, sp), state_snapshot(graph, sg)
        for k in snap_p:
            assert (snap_p[k] - snap_g[k]).abs().max().item() < 1e-4, k


def test_padding_never_writes_live_state(tiny_runner):
    """A padded bucket's extra requests address only the pad slot: a live request that sits out a step keeps
    every pool cell, and the trash page is the only page the pad slot touches."""
    runner = tiny_runner(**SMALL)
    graph = GraphRunner(runner, widths=(1,), buckets=(4,), fused=True)
    a, b = graph.allocate(), graph.allocate()
    graph.forward([a], [prompt(40, 1)])
    graph.forward([b], [prompt(33, 2)])
    before = state_snapshot(graph, b)
    pages_b = list(runner.pools.seq_pages[b])
    for t in range(8):
        graph.forward([a], [[3 + t]])  # bucket 4: three padding requests per step
    after = state_snapshot(graph, b)
    for k in before:
        torch.testing.assert_close(before[k], after[k], atol=0, rtol=0)
    assert runner.pools.seq_pages[b] == pages_b
    assert graph.pad_slot not in runner.pools.seq_pages or not runner.pools.seq_pages[graph.pad_slot]
    assert graph.describe()["cuda_graphs"]["captured"] == ["4x1"]


def test_baseline_and_static_references_match_engine_hyper_and_moe(tiny_runner):
    """The references of the benchmarks' baseline ops (CPU) compute the engine's own mHC and MoE."""
    runner = tiny_runner(**SMALL)
    layer = runner.model.layers[2]
    streams = torch.randn(5, runner.config.hc_mult, runner.config.hidden_size)
    ref = layer.attn_hc(streams)
    got = baseline_ops.hc_pre(layer.attn_hc, streams)
    for r, g in zip(ref, got):
        assert (r - g).abs().max().item() < 1e-5
    from evalpipe.engine.static.graphs import StaticModel

    sm = StaticModel(runner.model, fused=False)
    x = torch.randn(5, runner.config.hidden_size)
    ids = torch.tensor([3, 9, 27, 81, 243])
    for lyr in runner.model.layers:  # hash-MoE and learned-router MoE layers
        assert (lyr.mlp(x, ids) - sm.moe(lyr.mlp, x, ids)).abs().max().item() < 1e-5


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA-graph capture/replay needs a CUDA GPU (none here); the dry path above covers the "
    "step logic, benchmarks/serving/gpu_serving.py runs the captured graphs on the H200",
)
def test_captured_graph_replays_equal_eager(tiny_runner):
    plain = tiny_runner(**SMALL, device="cuda")
    base = tiny_runner(**SMALL, device="cuda")
    graph = GraphRunner(base, widths=(1, 6), buckets=(1, 2, 4), fused=True)
    sp, sg = plain.allocate(), graph.allocate()
    toks = prompt(45, 9)
    last = int(plain.forward([sp], [toks])[0].argmax())
    graph.forward([sg], [toks])
    for _ in range(10):
        a = plain.forward([sp], [[last]])
        b = graph.forward([sg], [[last]])
        assert (a - b).abs().max().item() < 1e-3
        last = int(a[0].argmax())
    assert graph.steps[(1, 1)].replays == 10


def test_serving_runner_and_drafter_on_the_wrapped_runner(tiny_runner, cache_dir, monkeypatch):
    """`evalpipe serve` wiring: on the CPU the plain runner (max_batch slots); a GraphRunner hands drafters its
    wrapped ModelRunner (layerskip views copy a ModelRunner, not the wrapper) and still decodes speculatively."""
    from evalpipe.engine.build import build, capture_drafter
    from evalpipe.engine.config import EngineConfig
    from evalpipe.engine.model.names import TINY_MODEL_NAME
    from evalpipe.engine.sampling_params import SamplingParams
    from evalpipe.engine.scheduler import Sequence
    from evalpipe.engine.spec.decoder import decoder_from_settings

    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(cache_dir))
    plain, served_decoder = build(
        EngineConfig(
            model=TINY_MODEL_NAME,
            max_batch=5,
            max_seq_len=SMALL["max_seq_len"],
            speculative="block",
            drafter="layerskip:2",
        )
    )
    assert isinstance(plain, ModelRunner) and plain.max_seqs == 5
    assert not capture_drafter(served_decoder, plain)  # nothing to capture on the CPU
    graph = GraphRunner(tiny_runner(**SMALL), widths=(1, 3), buckets=(1, 2), fused=True)
    assert graph.eager_runner is graph.runner and graph.max_seqs == graph.runner.max_seqs - 1
    decoder = decoder_from_settings(EngineConfig(speculative="block", block_size=2, drafter="layerskip:2"), graph)
    assert capture_drafter(decoder, graph) and isinstance(decoder.drafter.runner, GraphRunner)
    assert not capture_drafter(decoder, graph)  # already wrapped
    seq = Sequence(prompt=prompt(30, 5), params=SamplingParams(max_tokens=12, temperature=0.0))
    seq.slot = graph.allocate()
    seq.output.append(int(graph.forward([seq.slot], [seq.prompt[:]])[0].argmax()))
    ref = tiny_runner(**SMALL)
    rs = ref.allocate()
    want = [int(ref.forward([rs], [seq.prompt[:]])[0].argmax())]
    for _ in range(12):
        want.append(int(ref.forward([rs], [[want[-1]]])[0].argmax()))
    while len(seq.output) < 10:
        decoder.verify_step([seq])
    assert seq.output[:10] == want[:10]
    assert (1, 3) in graph.steps  # the verify forwards ran the static 3-row step
    assert (1, 1) in decoder.drafter.runner.steps  # and the drafter's one-row steps ran its static step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stream synchronisation is a CUDA notion; needs a GPU")
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_prompt_chunk_forward_never_waits_for_the_gpu(tiny_runner, prefix_cache):
    """The eager forward of prompt chunks (bf16, the server's sites: grouped-GEMM experts on Hopper) queues all its
    work without one host<->device synchronisation: a sync mid-forward drains the GPU and leaves it idle while the
    host queues the next layer (benchmarks/gpu_results/2026-12-06/prefill-syncs: 27 syncs per chunk before)."""
    from evalpipe.engine.model.fused_sites import SiteSettings

    runner = tiny_runner(
        max_seqs=3,
        max_seq_len=512,
        device="cuda",
        dtype=torch.bfloat16,
        sites=SiteSettings(),
        prefix_cache=prefix_cache,
        page_tokens=8,
    )
    a, b = runner.allocate(), runner.allocate()
    runner.forward([a], [prompt(40, 1)])  # warm-up: compiles the kernels, fills the rings
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = runner.forward([a, b], [prompt(37, 2), prompt(90, 3)])  # two chunk lengths: two groups
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape[0] == 2 and bool(torch.isfinite(logits).all())
