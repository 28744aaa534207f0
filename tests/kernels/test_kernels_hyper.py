"""evalpipe/kernels/hyper.py (mHC between blocks in two kernels) in Triton's CPU interpreter, float32: each kernel
against its PyTorch reference and against the engine path it replaces (HyperConnection.__call__ + rms_norm,
HyperConnection.merge, HyperHead), on random hyper-connections and on the tiny model's own, plus a two-layer chain
with stand-in blocks, determinism and rows of huge / tiny magnitude."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from evalpipe.engine.model import primitives
from evalpipe.engine.model.hyper import HyperConnection, HyperHead
from evalpipe.kernels import hyper as step_hyper

HC, D, EPS = 4, 64, 1e-6


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output buffer starts as NaN, so an element a kernel forgets to write fails the comparisons."""
    monkeypatch.setattr(
        step_hyper,
        "_empty",
        lambda *shape, **kw: torch.full(
            shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape, float("nan"), **kw
        ),
    )


def config():
    from transformers import DeepseekV4Config

    return DeepseekV4Config(hidden_size=D, hc_mult=HC, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=EPS)


def make_conn(gen, cfg):
    M = 2 * HC + HC * HC
    return HyperConnection(
        torch.randn(M, HC * D, generator=gen) / 8,
        0.5 * torch.randn(M, generator=gen),
        1 + 0.1 * torch.randn(3, generator=gen),
        cfg,
    )


def make_head(gen, cfg):
    return HyperHead(
        torch.randn(HC, HC * D, generator=gen) / 8,
        0.5 * torch.randn(HC, generator=gen),
        1 + 0.1 * torch.randn(1, generator=gen),
        cfg,
    )


def close(got, want, tol, name=""):
    """Max abs difference relative to want's largest magnitude (per row for the partials' callers)."""
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), name
    scale = want.abs().max().clamp_min(1e-30)
    assert ((got - want).abs().max() / scale).item() < tol, f"{name}: {(got - want).abs().max().item()}"


def rows_close(got, want, tol, name=""):
    """Partials [T, nb, M + 1]: each row relative to its own largest value (rows of very different scale)."""
    for t in range(want.shape[0]):
        close(got[t], want[t], tol, f"{name} row {t}")


def streams_with_extremes(gen, T):
    s = torch.randn(T, HC, D, generator=gen)
    if T > 2:  # one huge and one tiny row: the RMS scale must cancel their magnitude
        s[1] *= 1e15
        s[2] *= 1e-15
    return s


# The GEMM-tile merge/mix kernel takes over from DOT_MIN_ROWS rows (128); the tests lower that threshold to 32 so
# that 34 rows reach it (two 32-row tiles, the last one mostly padding) with a quarter of the per-row programs of
# 130 rows (pre_norm runs two programs per row): the dispatch rule and the kernel are the same, only fewer tiles.
DOT_T = 34


@pytest.fixture
def dot_from_32(monkeypatch):
    monkeypatch.setattr(step_hyper, "DOT_MIN_ROWS", 32)


# DOT_T rows: past DOT_MIN_ROWS, the GEMM-tile merge/mix kernel, its last tile of 32 rows mostly padding; DECODE_T:
# the per-row kernel at the decode steps' launch (2 rows and 2 warps a program, mix_block's 64-column blocks)
DECODE_T = 20


@pytest.mark.parametrize("T", [1, 6, DECODE_T, DOT_T])
def test_mix_and_pre_norm_match_reference_and_engine(T, dot_from_32):
    gen = torch.Generator().manual_seed(10 + T)
    cfg = config()
    conn = make_conn(gen, cfg)
    s = streams_with_extremes(gen, T)
    w = 1 + 0.1 * torch.randn(D, generator=gen)
    parts = step_hyper.hc_mix(s, conn, backend="triton")
    want = step_hyper.hc_mix_reference(s, conn.fn)
    assert parts.shape == (T, D // step_hyper.mix_block(D, T), 2 * HC + HC * HC + 1)
    rows_close(parts, want, 1e-5, "partials")
    # the partials' dot products add up to the engine's mixing GEMV, the last column to the sum of squares
    x = s.flatten(1)
    rows_close(
        torch.cat([parts.sum(1)[:, :-1], parts.sum(1)[:, -1:]], -1).unsqueeze(1),
        torch.cat([F.linear(x, conn.fn), x.square().sum(-1, keepdim=True)], -1).unsqueeze(1),
        1e-5,
        "sums",
    )

    got = step_hyper.hc_pre_norm(s, parts, conn, w, EPS, backend="triton")
    ref = step_hyper.hc_pre_norm(s, parts, conn, w, EPS, backend="reference")
    post, comb, collapsed = conn(s)
    engine = (post, comb, primitives.rms_norm(collapsed, w, EPS))
    for name, g, r, e in zip(("post", "comb", "x"), got, ref, engine):
        close(g, r, 1e-5, name + " vs reference")
        close(g, e, 1e-5, name + " vs engine")
    # comb is doubly stochastic (up to eps), post in (0, 2)
    assert (got[1].sum(-2) - 1).abs().max() < 1e-4 and (got[0] > 0).all() and (got[0] < 2).all()
    # the engine's RMSNorm of the huge / tiny rows is O(1): the kernel saw the same magnitude-free mixes
    assert got[2].abs().max() < 10


@pytest.mark.parametrize("T", [1, 6, DECODE_T, DOT_T])
def test_merge_mix_matches_reference_and_engine(T, dot_from_32):
    gen = torch.Generator().manual_seed(20 + T)
    cfg = config()
    conn, nxt, head = make_conn(gen, cfg), make_conn(gen, cfg), make_head(gen, cfg)
    s = streams_with_extremes(gen, T)
    y = torch.randn(T, D, generator=gen) * s.flatten(1).abs().amax(-1, keepdim=True)
    post, comb, _ = conn(s)
    for target in (nxt, head):  # the next block's hyper-connection (24 mixes) or the model head (4)
        new, parts = step_hyper.hc_merge_mix(s, y, post, comb, target, backend="triton")
        new_r, parts_r = step_hyper.hc_merge_mix(s, y, post, comb, target, backend="reference")
        for t in range(T):
            close(new[t], new_r[t], 1e-6, f"streams row {t} vs reference")
            close(new[t], HyperConnection.merge(s, y, post, comb)[t], 1e-5, f"streams row {t} vs engine merge")
        rows_close(parts, parts_r, 1e-5, "partials")
        rows_close(parts, step_hyper.hc_mix_reference(new, target.fn), 1e-5, "partials of the stored streams")


def test_head_norm_matches_reference_and_engine():
    gen = torch.Generator().manual_seed(3)
    cfg = config()
    head = make_head(gen, cfg)
    s = streams_with_extremes(gen, 6)
    w = 1 + 0.1 * torch.randn(D, generator=gen)
    parts = step_hyper.hc_mix(s, head, backend="triton")
    assert parts.shape[-1] == HC + 1
    got = step_hyper.hc_head_norm(s, parts, head, w, EPS, backend="triton")
    close(got, step_hyper.hc_head_norm(s, parts, head, w, EPS, backend="reference"), 1e-5, "vs reference")
    close(got, primitives.rms_norm(head(s), w, EPS), 1e-5, "vs engine")


def test_deterministic_and_row_grouping_free(monkeypatch):
    """Two runs are bitwise equal, and grouping rows into programs (4 rows a program, the last group half
    empty) changes no bit."""
    gen = torch.Generator().manual_seed(4)
    cfg = config()
    conn, nxt = make_conn(gen, cfg), make_conn(gen, cfg)
    s, y = torch.randn(6, HC, D, generator=gen), torch.randn(6, D, generator=gen)
    w = 1 + 0.1 * torch.randn(D, generator=gen)

    def run():
        parts = step_hyper.hc_mix(s, conn, backend="triton")
        post, comb, x = step_hyper.hc_pre_norm(s, parts, conn, w, EPS, backend="triton")
        new, parts2 = step_hyper.hc_merge_mix(s, y, post, comb, nxt, backend="triton")
        return parts, post, comb, x, new, parts2

    first, second = run(), run()
    monkeypatch.setattr(step_hyper, "_rows_per_program", lambda T: 4)
    monkeypatch.setattr(step_hyper, "NORM_SPLIT", False)  # Sinkhorn in the collapsing program: same numbers
    grouped = run()
    for a, b, c in zip(first, second, grouped):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_gemm_tile_path_taken_and_deterministic(monkeypatch, dot_from_32):
    """From DOT_MIN_ROWS rows (lowered to 32, see DOT_T) the merge/mix runs on the GEMM-tile kernel: it is the one
    launched, two runs are bitwise equal, and its partials match the per-row kernel's (same blocks, another
    summation order)."""
    gen = torch.Generator().manual_seed(6)
    cfg = config()
    conn, nxt = make_conn(gen, cfg), make_conn(gen, cfg)
    T = step_hyper.DOT_MIN_ROWS + 5
    s, y = torch.randn(T, HC, D, generator=gen), torch.randn(T, D, generator=gen)
    post, comb, _ = conn(s)
    launched = []
    real_jit = step_hyper.jit
    monkeypatch.setattr(step_hyper, "jit", lambda fn, *a: launched.append(fn.__name__) or real_jit(fn, *a))
    first = step_hyper.hc_merge_mix(s, y, post, comb, nxt, backend="triton")
    second = step_hyper.hc_merge_mix(s, y, post, comb, nxt, backend="triton")
    assert launched == ["_merge_mix_dot_kernel"] * 2
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    monkeypatch.setattr(step_hyper, "DOT_MIN_ROWS", 1 << 30)  # the per-row kernel on the same inputs
    per_row = step_hyper.hc_merge_mix(s, y, post, comb, nxt, backend="triton")
    assert launched[-1] == "_merge_mix_kernel"
    close(first[0], per_row[0], 1e-6, "streams")
    rows_close(first[1], per_row[1], 1e-5, "partials")


def test_partials_must_fit():
    gen = torch.Generator().manual_seed(5)
    cfg = config()
    conn, head = make_conn(gen, cfg), make_head(gen, cfg)
    s = torch.randn(2, HC, D, generator=gen)
    w = torch.ones(D)
    with pytest.raises(ValueError):
        step_hyper.hc_pre_norm(s, step_hyper.hc_mix(s, head, backend="reference"), conn, w, EPS)
    with pytest.raises(ValueError):
        step_hyper.hc_head_norm(s, step_hyper.hc_mix(s, conn, backend="reference"), head, w, EPS)


@pytest.fixture(scope="module")
def tiny_model(tiny_runner):
    return tiny_runner(max_seqs=2, max_seq_len=32).model


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_two_layer_chain_matches_engine(tiny_model, backend):
    """The whole mHC chain of the tiny model's first two layers and its head (real attn_hc / ffn_hc / head / norm
    weights; each block replaced by a fixed random output) against the engine's own chain, block input by block
    input."""
    m = tiny_model
    eps, T = m.config.rms_norm_eps, 3  # each row its own programs (T <= 8: one row a program), 3 as good as more
    gen = torch.Generator().manual_seed(6)
    layers = m.layers[:2]
    blocks = [b for layer in layers for b in ((layer.attn_hc, layer.attn_norm), (layer.ffn_hc, layer.mlp_norm))]
    x0 = F.embedding(torch.randint(0, m.embed.shape[0], (T,), generator=gen), m.embed)
    outs = [torch.randn(T, x0.shape[1], generator=gen) for _ in blocks]
    s_eng = s_new = x0.unsqueeze(1).expand(-1, m.config.hc_mult, -1).contiguous()
    parts = step_hyper.hc_mix(s_new, blocks[0][0], backend=backend)
    for i, ((conn, w), out) in enumerate(zip(blocks, outs)):
        post, comb, h = conn(s_eng)
        x_eng = primitives.rms_norm(h, w, eps)
        s_eng = HyperConnection.merge(s_eng, out, post, comb)
        post, comb, x_new = step_hyper.hc_pre_norm(s_new, parts, conn, w, eps, backend=backend)
        nxt = blocks[i + 1][0] if i + 1 < len(blocks) else m.head
        s_new, parts = step_hyper.hc_merge_mix(s_new, out, post, comb, nxt, backend=backend)
        close(x_new, x_eng, 1e-5, f"block {i} input")
        close(s_new, s_eng, 1e-5, f"streams after block {i}")
    got = step_hyper.hc_head_norm(s_new, parts, m.head, m.norm, eps, backend=backend)
    close(got, primitives.rms_norm(m.head(s_eng), m.norm, eps), 1e-5, "head")


def test_prepared_weights_go_with_their_object():
    """The per-object cache keeps no dropped model's weights alive."""
    import gc

    conn = make_conn(torch.Generator().manual_seed(7), config())
    step_hyper.hc_mix(torch.randn(1, HC, D), conn)
    key = id(conn)
    assert key in step_hyper._PREP
    del conn
    gc.collect()
    assert key not in step_hyper._PREP


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the NaN/inf neighbours
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_chain_row_is_bitwise_the_same_in_any_batch(dtype, monkeypatch):
    """`invariant=True` (--deterministic): mix -> pre-norm -> merge-mix -> head-norm of one row is bitwise the same
    alone and at a random place among 2 or 17 rows (17: past DOT_MIN_ROWS, lowered to 17 here) of other random
    data, one NaN and one inf row among them; the partials have mix_block's 128-column blocks at every T."""
    # the T thresholds of the launch: _rows_per_program (above 8 rows), mix_block (from 16) and DOT_MIN_ROWS, which
    # 17 rows pass once it is 17 instead of 128 (the invariant path ignores it; 130 rows ran 8x the programs)
    monkeypatch.setattr(step_hyper, "DOT_MIN_ROWS", 17)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh inputs every run
    cfg = config()
    conn, head = make_conn(gen, cfg), make_head(gen, cfg)
    w = 1 + 0.1 * torch.randn(D, generator=gen)
    row_s, row_y = torch.randn(HC, D, generator=gen).to(dtype), torch.randn(D, generator=gen).to(dtype)

    def chain(s, y):
        parts = step_hyper.hc_mix(s, conn, backend="triton", invariant=True)
        assert parts.shape[1] == 1  # D = 64 columns in one block, whatever T
        post, comb, x = step_hyper.hc_pre_norm(s, parts, conn, w, EPS, backend="triton", invariant=True)
        new, parts2 = step_hyper.hc_merge_mix(s, y, post, comb, head, backend="triton", invariant=True)
        out = step_hyper.hc_head_norm(new, parts2, head, w, EPS, backend="triton", invariant=True)
        return x, new, out

    alone = [t[0] for t in chain(row_s[None], row_y[None])]
    # 17 rows: 4 rows a program (_rows_per_program), the last group partial, and a batch on which the non-invariant
    # merge/mix takes the GEMM-tile kernel
    for batch in (2, 17):
        s = torch.randn(batch, HC, D, generator=gen).to(dtype)
        y = torch.randn(batch, D, generator=gen).to(dtype)
        at = int(torch.randint(0, batch, (1,), generator=gen))
        s[(at + 1) % batch], y[(at + 1) % batch] = float("nan"), float("nan")
        s[(at + 2) % batch] = float("inf")
        s[at], y[at] = row_s, row_y
        for got, want in zip(chain(s, y), alone):
            assert torch.equal(got[at], want), f"batch {batch}"
