"""evalpipe/kernels/moe.py: the 4-launch MoE block, its Triton kernels run in Triton's CPU interpreter (float32,
small shapes) against the module's references and against the engine's own `MoE` (`MoE.__call__`, `MoE.route`)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from evalpipe.engine.model.moe import MoE
from evalpipe.kernels import moe as step_moe

D, INTER, E, K, VOCAB, LIMIT = 64, 32, 8, 2, 50, 10.0


def make_moe(*, scoring="sqrtsoftplus", is_hash=False, bias=True, seed=0, act="silu", E=E, K=K):
    """An engine MoE over a random state dict (the checkpoint's key names)."""
    g = torch.Generator().manual_seed(seed)
    sd = {
        "gate.weight": torch.randn(E, D, generator=g) / D**0.5,
        "experts.gate_up_proj": torch.randn(E, 2 * INTER, D, generator=g) / D**0.5,
        "experts.down_proj": torch.randn(E, D, INTER, generator=g) / INTER**0.5,
        "shared_experts.gate_proj.weight": torch.randn(INTER, D, generator=g) / D**0.5,
        "shared_experts.up_proj.weight": torch.randn(INTER, D, generator=g) / D**0.5,
        "shared_experts.down_proj.weight": torch.randn(D, INTER, generator=g) / INTER**0.5,
    }
    if bias:
        sd["gate.e_score_correction_bias"] = 0.5 * torch.randn(E, generator=g)
    if is_hash:
        sd["gate.tid2eid"] = torch.randint(0, E, (VOCAB, K), generator=g)
    cfg = SimpleNamespace(
        num_experts_per_tok=K, scoring_func=scoring, routed_scaling_factor=1.5, swiglu_limit=LIMIT, hidden_act=act
    )
    return MoE(sd, "", cfg, is_hash)


def sorted_picks(idx, w):
    order = idx.long().argsort(dim=-1)
    return idx.long().gather(1, order), w.float().gather(1, order)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("is_hash", [False, True])
def test_route_kernel_matches_reference_and_engine(scoring, is_hash):
    gen = torch.Generator().manual_seed(len(scoring) + is_hash)
    moe = make_moe(scoring=scoring, is_hash=is_hash, seed=3)
    T = 9
    logits = 4 * torch.randn(T, E, generator=gen)
    logits[0, 0] = 30.0  # softplus identity branch
    logits[1, 1] = -40.0  # tiny softplus (log1p accuracy)
    ids = torch.randint(0, VOCAB, (T,), generator=gen)
    idx, w = step_moe.route(moe, logits, ids, backend="triton")
    ridx, rw = step_moe.route_reference(moe, logits, ids)
    assert idx.dtype == torch.int32 and w.dtype == torch.float32 and idx.shape == w.shape == (T, K + 1)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)
    assert (idx[:, K] == E).all() and (w[:, K] == 1.0).all()  # the shared expert column
    # the engine's routing (unsorted top-k, no shared column): same picks, same weights
    eidx, ew = moe.route(None, ids, logits)
    a, aw = sorted_picks(idx[:, :K], w[:, :K])
    b, bw = sorted_picks(eidx, ew)
    assert torch.equal(a, b)
    torch.testing.assert_close(aw, bw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_route_ties_pick_lowest_expert_first(scoring):
    """Exact ties in the (biased) scores go to the lowest expert index, in order, like a stable descending sort."""
    moe = make_moe(scoring=scoring, bias=False, seed=4)
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(5))
    logits[0] = 0.0  # all equal -> experts 0, 1
    logits[1] = -1.0
    logits[1, [6, 2, 5]] = 2.0  # three-way tie at the top -> 2, 5
    logits[2] = -1.0
    logits[2, 7] = 3.0
    logits[2, [4, 3]] = 1.0  # a unique max, then a tie -> 7, 3
    ids = torch.zeros(4, dtype=torch.long)
    idx, w = step_moe.route(moe, logits, ids, backend="triton")
    assert idx[:3, :K].tolist() == [[0, 1], [2, 5], [7, 3]]
    assert torch.equal(idx, step_moe.route_reference(moe, logits, ids)[0])
    torch.testing.assert_close(w[0, :K], torch.full((K,), 1.5 / K))  # equal scores share the scaling equally
    biased = make_moe(scoring=scoring, bias=True, seed=4)
    biased.bias = torch.tensor([0.0, 0.25, 0.0, 0.0, 0.25, 0.0, 0.0, 0.0])  # ties made by the bias: 1, 4
    idx, _ = step_moe.route(biased, torch.zeros(2, E), ids[:2], backend="triton")
    assert idx[:, :K].tolist() == [[1, 4], [1, 4]]


def picks(T, gen, E=E):
    routed = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return torch.cat([routed, torch.full((T, 1), E)], 1).to(torch.int32)


@pytest.mark.parametrize("T", [5, 20, 70])
def test_gate_up_and_down_kernels_match_references(T):
    """Both kernel shapes (GEMV per pick; expert-major tl.dot over compacted picks) with clamping active on both
    sides of the SwiGLU, heuristic blocks and blocks that split D and I into several steps, leave masked channel
    tails, split tokens into several token blocks (a partial last one) and picks of one expert into several
    BLOCK_M chunks (T 20: the shared expert has 20 picks; T 70: the large-batch shapes of MM_LARGE, 64-row token
    blocks and 64-row dot tiles, with a partial second block)."""
    gen = torch.Generator().manual_seed(11 + T)
    moe = make_moe(seed=6)
    x = 12 * torch.randn(T, D, generator=gen)
    idx = picks(T, gen)
    gate = torch.stack(
        [torch.stack([step_moe._expert(step_moe.prepare(moe), int(e))[0] @ x[t] for e in idx[t]]) for t in range(T)]
    )
    assert (gate > LIMIT).any() and (gate < -LIMIT).any()  # the clamps matter for this input
    hr = step_moe.gate_up_reference(moe, x, idx)
    w = torch.rand(T, K + 1, generator=gen)
    w[:, K] = 1.0
    yr = step_moe.down_reference(moe, hr, idx, w)
    # auto is "mm" for both kernels from T 4 (MM_MIN_TOKENS), with the same launch shape as an explicit mode "mm":
    # dict() is that case at every T. The GEMVs (one program per pick) run the same code at any T, so T 5 has them;
    # the explicit 8-row token blocks make several blocks with a partial last one at T 20 (one block at T 5). T 70
    # checks the large-batch shapes only
    cfgs = [dict()]
    if T == 5:
        cfgs += [dict(mode="gemv", block_n=16, block_k=16), dict(mode="gemv", block_n=64, block_k=32)]
    elif T == 20:
        cfgs += [dict(mode="mm", block_t=8, block_n=16, block_k=16)]
    for cfg in cfgs:
        h = step_moe.gate_up(moe, x, idx, backend="triton", **cfg)
        assert h.shape == (T, K + 1, INTER) and torch.isfinite(h).all()
        torch.testing.assert_close(h, hr, rtol=1e-5, atol=1e-4, msg=str(cfg))
        y = step_moe.down(moe, hr, idx, w, backend="triton", **cfg)
        assert y.shape == (T, D) and torch.isfinite(y).all()
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-4, msg=str(cfg))


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty hands out NaN-filled floats (-1 for integers): an output or partial element that a kernel
    leaves unwritten shows up as a NaN."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    monkeypatch.setattr(torch, "empty", empty)


def awkward_picks(T, gen):
    """Picks [T, K+1] with the shared column, routed only to experts 0..4 (5..7 idle: whole empty groups at G 9),
    and a third of the tokens picking one expert twice (a hash table can hold a repeated expert)."""
    idx = torch.stack([torch.randperm(5, generator=gen)[:K] for _ in range(T)])
    twice = torch.rand(T, generator=gen) < 1 / 3
    idx[twice, 1] = idx[twice, 0]
    return torch.cat([idx, torch.full((T, 1), E)], 1).to(torch.int32)


@pytest.mark.parametrize("groups", [1, 2, 3, E + 1])
def test_down_expert_groups_match_reference(groups, poisoned_empty):
    """down's "mm" path split into `expert_groups` groups of experts (fp32 partials summed in group order, one
    rounding) agrees with down_reference: T 1, T not a multiple of the token block (37 over 16-row blocks, 70 over
    64-row ones), repeated picks, experts nobody picked, and outputs and partials poisoned with NaN before the
    launch. Fresh random inputs every run."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    moe = make_moe(seed=int(torch.randint(0, 1 << 20, (), generator=gen)))
    for T, block_t in ((1, 16), (37, 16), (70, 64)):
        h = 4 * torch.randn(T, K + 1, INTER, generator=gen)
        idx = awkward_picks(T, gen)
        w = torch.rand(T, K + 1, generator=gen)
        w[:, K] = 1.0
        yr = step_moe.down_reference(moe, h, idx, w)
        y = step_moe.down(moe, h, idx, w, backend="triton", mode="mm", block_t=block_t, expert_groups=groups)
        assert y.shape == (T, D) and torch.isfinite(y).all(), f"T {T}"
        torch.testing.assert_close(y, yr, rtol=1e-5, atol=1e-4, msg=f"T {T}")


@pytest.mark.parametrize(
    "cfg",
    [
        dict(),  # the "rows" table shape at T 70 (64-row token blocks and dot tiles), the kernel's own below it
        dict(block_t=16, block_m=16, block_n=16, block_k=16),  # channel and reduction tails, several token blocks
        dict(block_t=8, block_m=64, block_n=64, block_k=32, maxnreg=128),
    ],
)
def test_down_rows_match_reference(cfg, poisoned_empty):
    """down's "rows" mode (one fp32 row per pick from expert-major tl.dot programs, then each token's K + 1 rows
    summed in pick order) agrees with down_reference at T 1 and 37 (and 70 for the table's shape): repeated picks,
    experts nobody picked, a partial last token block, outputs and the per-pick rows poisoned with NaN before the
    launch. Fresh random inputs every run."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    moe = make_moe(seed=int(torch.randint(0, 1 << 20, (), generator=gen)))
    # the explicit 16- and 8-row token blocks already make several blocks with a partial last one at T 37; T 70
    # adds only programs to them, and is where dict() takes MM_LARGE["down_rows"]'s 64-row shape
    for T in (1, 37, 70) if not cfg else (1, 37):
        h = 4 * torch.randn(T, K + 1, INTER, generator=gen)
        idx = awkward_picks(T, gen)
        w = torch.rand(T, K + 1, generator=gen)
        w[:, K] = 1.0
        y = step_moe.down(moe, h, idx, w, backend="triton", mode="rows", **cfg)
        assert y.shape == (T, D) and torch.isfinite(y).all(), f"T {T}"
        torch.testing.assert_close(y, step_moe.down_reference(moe, h, idx, w), rtol=1e-5, atol=1e-4, msg=f"T {T}")


@pytest.mark.parametrize("start", [step_moe.DOWN_ROWS_FROM, 32, None])
def test_down_auto_takes_rows_from_its_row_count(start, monkeypatch):
    """auto's choice for down by T: the GEMVs below MM_MIN_TOKENS, "mm" up to DOWN_ROWS_FROM, "rows" from there
    (never while it is None); gate_up has no "rows"."""
    monkeypatch.setattr(step_moe, "DOWN_ROWS_FROM", start)
    below = step_moe.MM_MIN_TOKENS["down"]
    assert step_moe._mode("auto", "down", below - 1) == "gemv" and step_moe._mode("auto", "down", below) == "mm"
    if start is None:
        assert step_moe._mode("auto", "down", 1 << 16) == "mm"
    else:
        assert step_moe._mode("auto", "down", start - 1) == "mm" and step_moe._mode("auto", "down", start) == "rows"
    assert step_moe._mode("auto", "gate_up", 1 << 16) == "mm"
    with pytest.raises(ValueError, match="mode must be"):
        step_moe._mode("rows", "gate_up", 64)


@pytest.mark.parametrize("cfg", [dict(mode="mm", expert_groups=g) for g in (1, 2, 3, E + 1)] + [dict(mode="rows")])
def test_down_non_finite_pick_stays_in_its_token(cfg):
    """A NaN in one token's h and an inf in another's, both in the token block of 30 other tokens: those two rows
    come out non-finite and every other row is bitwise the clean run's (in "mm", the one-hot dot that adds picks to
    their token must not spread 0 * inf over the block; in "rows", a pick's row must reach its own token only)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    moe = make_moe(seed=5)
    T = 32
    h = torch.randn(T, K + 1, INTER, generator=gen)
    idx, w = picks(T, gen), torch.rand(T, K + 1, generator=gen)
    nan_tok, inf_tok = torch.randperm(T, generator=gen)[:2].tolist()
    bad = h.clone()
    bad[nan_tok, 0, 3] = float("nan")
    bad[inf_tok, K, 7] = float("inf")  # the shared expert's pick
    cfg = dict(backend="triton", block_t=32, **cfg)
    clean, dirty = step_moe.down(moe, h, idx, w, **cfg), step_moe.down(moe, bad, idx, w, **cfg)
    others = [t for t in range(T) if t not in (nan_tok, inf_tok)]
    assert torch.isfinite(clean).all() and torch.equal(dirty[others], clean[others])
    assert torch.isnan(dirty[nan_tok]).all() and not torch.isfinite(dirty[inf_tok]).any()


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("kind", ["moe", "hash", "sigmoid"])
def test_moe_forward_matches_engine_moe(T, kind):
    """moe_forward (4 launches, Triton interpreted) == engine MoE.__call__ on the same object, with activations
    large enough that swiglu_limit clamps. T 1: both GEMVs; T 6: both expert-major "mm" kernels (T 13 ran the same
    kernels, in one token block each as T 6)."""
    moe = make_moe(scoring="sigmoid" if kind == "sigmoid" else "sqrtsoftplus", is_hash=kind == "hash", seed=7 + T)
    gen = torch.Generator().manual_seed(100 + T)
    x = 8 * torch.randn(T, D, generator=gen)
    ids = torch.randint(0, VOCAB, (T,), generator=gen)
    pre = F.linear(x, moe.gate_up.reshape(-1, D))
    assert pre.abs().max() > LIMIT  # clamping is active
    y = step_moe.moe_forward(moe, x, ids, backend="triton")
    ye = moe(x, ids)
    assert y.shape == ye.shape == (T, D) and y.dtype == x.dtype
    assert (y - ye).abs().max().item() < 1e-4 * max(1.0, ye.abs().max().item())
    yr = step_moe.moe_forward(moe, x, ids, backend="reference")
    assert (y - yr).abs().max().item() < 1e-4 * max(1.0, yr.abs().max().item())


def test_moe_forward_on_tiny_model_layers(tiny_runner):
    """The default tiny model's own MoE objects as ModelRunner builds them (a hash_moe and a moe layer, E 8,
    top-2, I 128, hidden 256), T = 6 rows. Both kernels in mode "mm" with 64-channel blocks: the objects are what
    this test is about; the default 32- and 16-channel blocks (4x the programs on the interpreter, each walking
    every expert) run in the tests above on the same code."""
    layers = tiny_runner(max_seqs=2, max_seq_len=64).model.layers
    gen = torch.Generator().manual_seed(21)
    for layer in (layers[0], layers[2]):
        moe = layer.mlp
        assert moe.is_hash == (layer is layers[0])
        x = 3 * torch.randn(6, moe.gate_up.shape[-1], generator=gen)
        ids = torch.randint(0, moe.tid2eid.shape[0] if moe.is_hash else 512, (6,), generator=gen)
        cfg = dict(mode="mm", block_n=64)
        y = step_moe.moe_forward(moe, x, ids, backend="triton", gate_up_cfg=cfg, down_cfg=cfg)
        ye = moe(x, ids)
        assert (y - ye).abs().max().item() < 1e-4 * max(1.0, ye.abs().max().item())


def test_dispatch_and_guards():
    moe = make_moe(seed=9)
    x = torch.randn(3, D)
    ids = torch.zeros(3, dtype=torch.long)
    ref = step_moe.moe_forward(moe, x, ids, backend="reference")
    torch.testing.assert_close(step_moe.moe_forward(moe, x, ids), ref)  # auto on CPU tensors: the reference
    assert step_moe.prepare(moe) is step_moe.prepare(moe)  # prepared once per object ...
    dropped = make_moe(seed=10)
    step_moe.prepare(dropped)
    gc.collect()  # entries of earlier tests' dead objects go first, so the count below moves by this one alone
    n = len(step_moe._PREPARED)
    del dropped
    gc.collect()
    assert len(step_moe._PREPARED) == n - 1  # ... and the entry goes with its object
    gelu = make_moe(seed=9, act="gelu")
    with pytest.raises(ValueError):
        step_moe.moe_forward(gelu, x, ids, backend="triton")
    torch.testing.assert_close(step_moe.moe_forward(gelu, x, ids), gelu(x, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        step_moe.moe_forward(moe, x, ids, backend="cuda")
    empty = step_moe.moe_forward(moe, x[:0], ids[:0], backend="triton")
    assert empty.shape == (0, D)
    for groups in (0, E + 2, 1.5):  # the E + 1 experts make 1..E + 1 groups
        with pytest.raises(ValueError, match="expert_groups"):
            step_moe.moe_forward(moe, x, ids, backend="triton", down_cfg=dict(mode="mm", expert_groups=groups))
    with pytest.raises(ValueError, match="expert_groups is for down's mode 'mm'"):
        step_moe.moe_forward(moe, x, ids, backend="triton", down_cfg=dict(mode="rows", expert_groups=1))
    with pytest.raises(ValueError, match="maxnreg is for down's mode 'rows'"):
        step_moe.moe_forward(moe, x, ids, backend="triton", down_cfg=dict(mode="mm", maxnreg=128))
    with pytest.raises(ValueError, match="invariant: down's mode is 'rows' or 'mm'"):
        step_moe.moe_forward(moe, x, ids, backend="triton", invariant=True, down_cfg=dict(mode="gemv"))


def test_static_step_with_moe_forward_equals_plain_runner(tiny_runner, monkeypatch):
    """The integration as StaticModel will call it: a GraphRunner decode step (dry path, bucket 2) whose MoE blocks
    run moe_forward's Triton kernels (interpreted) gives the plain runner's logits."""
    from evalpipe.engine.static.graphs import GraphRunner, StaticModel

    calls = []

    def moe(self, moe_obj, x, input_ids):
        calls.append(x.shape[0])
        return step_moe.moe_forward(moe_obj, x, input_ids, backend="triton")

    monkeypatch.setattr(StaticModel, "moe", moe)
    plain = tiny_runner(max_seqs=3, max_seq_len=64)
    graph = GraphRunner(tiny_runner(max_seqs=3, max_seq_len=64), widths=(1,), buckets=(2,), fused=False)
    seqs_p, seqs_g = [plain.allocate(), plain.allocate()], [graph.allocate(), graph.allocate()]
    gen = torch.Generator().manual_seed(3)
    for sp, sg, n in zip(seqs_p, seqs_g, (9, 14)):
        toks = torch.randint(2, 500, (n,), generator=gen).tolist()
        plain.forward([sp], [toks])
        graph.forward([sg], [toks])  # prefill: delegated to the plain runner
    rows = [[5], [77]]
    a, b = plain.forward(seqs_p, rows), graph.forward(seqs_g, rows)
    assert calls == [2] * len(plain.model.layers)  # the static step ran, through moe_forward
    assert (a - b).abs().max().item() < 5e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37, 300])
def test_grouped_gemm_routed_experts_equal_the_per_expert_loop(T, dtype):
    """The engine MoE's routed sum through torch's grouped GEMM (what a prompt chunk runs on CUDA in bf16: no host
    read of the per-expert counts) equals its per-expert loop: experts with no pick (T 1), uneven groups, clamps
    active, the hash table's picks too."""
    for is_hash in (False, True):
        moe = make_moe(is_hash=is_hash, seed=3 + T)
        moe.gate_up, moe.down = moe.gate_up.to(dtype), moe.down.to(dtype)
        gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh inputs every run
        x = (8 * torch.randn(T, D, generator=gen)).to(dtype)
        ids = torch.randint(0, VOCAB, (T,), generator=gen)
        idx, w = moe.route(x.float(), ids)
        loop = moe.routed(x, idx, w, grouped=False)
        grouped = moe.routed(x, idx, w, grouped=True)
        assert grouped.dtype == loop.dtype == dtype and torch.isfinite(grouped).all()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (grouped.float() - loop.float()).abs().max().item() <= tol * max(1.0, loop.float().abs().max().item())


# "mm" over 3 and over E + 1 groups run the same kernel with a group axis and the same split_sum of the groups:
# one in each dtype (float32 3, bfloat16 E + 1), "rows" and "mm" over one group in both
@pytest.mark.parametrize(
    "dtype,down_mode,groups",
    [
        (torch.float32, "auto", None),
        (torch.bfloat16, "auto", None),
        (torch.float32, "mm", 1),
        (torch.bfloat16, "mm", 1),
        (torch.float32, "mm", 3),
        (torch.bfloat16, "mm", E + 1),
    ],
)
def test_invariant_moe_token_is_bitwise_the_same_in_any_batch(dtype, down_mode, groups):
    """`invariant=True` (--deterministic): one token's MoE output is bitwise the same alone and at a random place
    among 17 or 64 tokens of other random data, and close to the reference, with down's default ("rows") and with
    "mm" over 1, 3 or E + 1 expert groups. The chain is moe_forward's with its router GEMM through
    kernels.batch_invariant.matmul (what invariant_ops makes of it on CUDA). In the 17-token batch one neighbour
    is NaN: it must not reach the token."""
    from evalpipe.kernels import batch_invariant

    moe = make_moe(seed=13)
    moe.gate_up, moe.down = moe.gate_up.to(dtype), moe.down.to(dtype)
    moe.shared, moe.router = [s.to(dtype) for s in moe.shared], moe.router.to(dtype)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))  # fresh inputs every run
    router = moe.router

    def forward(x, ids):
        logits = batch_invariant.matmul(x, router.t(), backend="triton").float()
        idx, w = step_moe.route(moe, logits, ids, backend="triton")
        h = step_moe.gate_up(moe, x, idx, backend="triton", invariant=True)
        return step_moe.down(
            moe, h, idx, w, out_dtype=x.dtype, backend="triton", invariant=True, mode=down_mode, expert_groups=groups
        )

    token = (8 * torch.randn(1, D, generator=gen)).to(dtype)
    token_id = torch.randint(0, VOCAB, (1,), generator=gen)
    alone = forward(token, token_id)[0]
    ref = step_moe.moe_forward_reference(moe, token, token_id)[0]
    assert (alone.float() - ref.float()).abs().max().item() <= (1e-4 if dtype == torch.float32 else 3e-2) * max(
        1.0, ref.float().abs().max().item()
    )
    # the invariant launch shape has 64-token blocks at every T: 17 tokens are a partial block (as 2 were), 64 a
    # full one
    for batch in (17, 64):
        x = (8 * torch.randn(batch, D, generator=gen)).to(dtype)
        ids = torch.randint(0, VOCAB, (batch,), generator=gen)
        at = int(torch.randint(0, batch, (1,), generator=gen))
        if batch == 17:
            x[(at + 1) % batch, 0] = float("nan")
        x[at], ids[at] = token[0], token_id[0]
        assert torch.equal(forward(x, ids)[at], alone), f"batch {batch}"


def test_invariant_launch_shape_does_not_depend_on_T():
    for kernel in ("gate_up", "down", "down_rows"):
        shapes = {str(step_moe._mm_shape(kernel, T, {"block_t": 8}, invariant=True)) for T in (1, 5, 64, 3000)}
        assert len(shapes) == 1
    groups = {step_moe._mm_shape("down", T, {}, invariant=True)["expert_groups"] for T in (1, 5, 64, 3000)}
    assert groups == {step_moe.MM_INVARIANT["down"]["expert_groups"]}  # the fixed shape's, whatever T
    assert {step_moe._token_block({"block_t": 64}, T, 32, True) for T in (1, 7, 64, 900)} == {64}


def test_down_table_groups_are_capped_at_the_experts_of_a_smaller_model():
    """MM_LARGE's down shape names G = 9 (E 8 + the shared expert); a model of 3 experts runs it with G = 4, the
    same sums as the reference, and an explicit G beyond E + 1 is refused."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    moe = make_moe(seed=4, E=3)
    T = step_moe.MM_LARGE["down"][0] + 7  # the table's shape applies
    assert step_moe.MM_LARGE["down"][1]["expert_groups"] > 4
    x = torch.randn(T, D, generator=gen)
    idx = picks(T, gen, E=3)
    w = torch.rand(T, K + 1, generator=gen)
    w[:, K] = 1.0
    h = step_moe.gate_up_reference(moe, x, idx)
    y = step_moe.down(moe, h, idx, w, backend="triton", mode="mm")  # named: auto's choice may move under it
    torch.testing.assert_close(y, step_moe.down_reference(moe, h, idx, w), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="expert_groups"):
        step_moe.down(moe, h, idx, w, backend="triton", mode="mm", expert_groups=5)


def test_a_launch_shape_sets_num_stages_and_registers_and_the_callers_num_stages_wins():
    """MM_LARGE's gate_up and down_rows shapes may name num_stages and maxnreg; an unset or zero value is left to
    Triton, and a num_stages the caller passes (the sweep's candidates) replaces the shape's."""
    shape = dict(block_n=64, num_stages=4, maxnreg=128)
    assert step_moe._compiler_options(shape, {}) == {"num_stages": 4, "maxnreg": 128}
    assert step_moe._compiler_options(shape, {"num_stages": 2}) == {"num_stages": 2, "maxnreg": 128}
    assert step_moe._compiler_options(dict(block_n=64, num_stages=None, maxnreg=0), {}) == {}
