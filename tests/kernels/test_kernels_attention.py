"""evalpipe/kernels/attention.py: the decode/verify attention core as one split-KV Triton kernel, run in Triton's
CPU interpreter (float32) against its PyTorch reference and against the engine's own `Attention._attend` on a real
tiny-model runner (sliding, CSA and HCA layers; decode and 6-row verify groups)."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.forward_batch import entry_index
from evalpipe.engine.model.attention import Attention
from evalpipe.engine.model.config import CSA, HCA, SLIDING
from evalpipe.kernels import attention as sa

TOL = 1e-5


def make_case(
    gen, *, B=3, n=6, H=4, D=64, W=8, margin=4, starts=(0, 40, 3), K=5, n_entries=50, pad_last=False, all_hidden=False
):
    """Random rows of B requests of n rows (request b starts at starts[b], slot b); the last request optionally a
    padding request (positions 0.., the spare slot S-1, entry rows -1)."""
    R = W - 1 + margin
    S = B + 1
    T = B * n
    pos = torch.cat([s + torch.arange(n) for s in starts[:B]])
    slot = torch.arange(B).repeat_interleave(n)
    rows = torch.randint(0, n_entries, (T, K), generator=gen)
    rows = torch.where(torch.rand(T, K, generator=gen) < 0.3, torch.full_like(rows, -1), rows)
    if pad_last:
        pos[-n:] = torch.arange(n)
        slot[-n:] = S - 1
        rows[-n:] = -1
    if all_hidden:
        rows[:] = -1
    return dict(
        q=torch.randn(T, H, D, generator=gen),
        kv=torch.randn(T, D, generator=gen),
        window_ring=torch.randn(S * R, D, generator=gen),
        ring_size=R,
        window=W,
        pos=pos,
        slot=slot,
        n=n,
        entries=torch.randn(n_entries, D, generator=gen),
        entry_rows=rows,
        sinks=torch.randn(H, generator=gen),
        scale=D**-0.5,
    )


def call(args, **over):
    a = dict(args, **over)
    return [
        a[k]
        for k in (
            "q",
            "kv",
            "window_ring",
            "ring_size",
            "window",
            "pos",
            "slot",
            "n",
            "entries",
            "entry_rows",
            "sinks",
            "scale",
        )
    ]


def brute_force(q, kv, ring, R, W, pos, slot, n, entries, rows, sinks, scale):
    """Row by row, key by key, straight from the contract (not from `_attend`'s op chain)."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for i in range(T):
        first = i - i % n
        keys = []
        for k in range(int(pos[i]) - W + 1, int(pos[i]) + 1):
            if k >= 0:
                fp = int(pos[first])
                keys.append(kv[first + k - fp] if k >= fp else ring[int(slot[i]) * R + k % R])
        if entries is not None and rows is not None:
            keys += [entries[int(r)] for r in rows[i] if r >= 0]
        keys = torch.stack(keys).double()
        logits = torch.cat([q[i].double() @ keys.T * scale, sinks.double()[:, None]], dim=1)
        probs = logits.softmax(dim=1)[:, :-1]
        out[i] = probs @ keys
    return out


@pytest.mark.parametrize("splits", [1, 3, None])
def test_kernel_matches_reference_and_contract(splits):
    """Verify rows (n=6) crossing the forward boundary, a request at position 0 (window partly non-existent), ring
    wrap (start 40, ring of 11), -1 entry rows, int32 rows; single kernel, split + merge, and the default plan."""
    gen = torch.Generator().manual_seed(1)
    args = make_case(gen)
    args["entry_rows"] = args["entry_rows"].to(torch.int32)
    ref = sa.fused_attention_reference(*call(args))
    got = sa._launch(*call(args), splits=splits)
    assert torch.isfinite(got).all() and got.dtype == torch.float32
    assert (got - ref).abs().max().item() < TOL
    assert (ref.double() - brute_force(*call(args))).abs().max().item() < TOL


@pytest.mark.parametrize("block_n,block_h,splits", [(64, 16, 1), (64, 32, 2), (16, 16, 4)])
def test_kernel_launch_configs(block_n, block_h, splits):
    """The production launch shapes (64-key chunks wider than the window, 16/32-head blocks past H) and narrow
    chunks with many splits give the same result."""
    gen = torch.Generator().manual_seed(11)
    args = make_case(gen, H=5, K=70, n_entries=90)
    ref = sa.fused_attention_reference(*call(args))
    got = sa._launch(*call(args), splits=splits, block_n=block_n, block_h=block_h)
    assert (got - ref).abs().max().item() < TOL


def test_kernel_unaligned_rows():
    """kv as a view with an odd row stride and odd offset (the kernel's row gather then takes no 8-element
    alignment hint), q as a strided view of a wider buffer, pos and slot as strided views: same result."""
    gen = torch.Generator().manual_seed(12)
    args = make_case(gen)
    T, H, D = args["q"].shape
    wide = torch.randn(T, D + 3, generator=gen)
    wide[:, 1 : D + 1] = args["kv"]
    qkv = torch.randn(T, H + 1, D, generator=gen)
    qkv[:, :H] = args["q"]
    ref = sa.fused_attention_reference(*call(args))
    pos_slot = torch.stack([args["pos"], args["slot"]], dim=1)  # strided views
    got = sa._launch(
        *call(args, kv=wide[:, 1 : D + 1], q=qkv[:, :H], pos=pos_slot[:, 0], slot=pos_slot[:, 1]), splits=2
    )
    assert (got - ref).abs().max().item() < TOL


def test_kernel_decode_rows_and_padding_request():
    """Decode (n=1) rows, one of them a padding request on the spare slot (every entry row -1)."""
    gen = torch.Generator().manual_seed(2)
    args = make_case(gen, B=4, n=1, starts=(5, 17, 0, 0), pad_last=True)
    ref = sa.fused_attention_reference(*call(args))
    for splits in (1, 2):
        got = sa._launch(*call(args), splits=splits)
        assert torch.isfinite(got).all() and (got - ref).abs().max().item() < TOL
    assert (ref.double() - brute_force(*call(args))).abs().max().item() < TOL


# the scan step and the split count are independent: every split count with the 16-slot steps (several steps per
# row), ENT_SCAN's one step with one of them
@pytest.mark.parametrize("ent_scan,splits", [(16, 1), (16, 3), (16, 8), (sa.ENT_SCAN, 3)])
def test_kernel_stops_after_the_last_visible_entry(ent_scan, splits, monkeypatch):
    """An entry axis far longer than what rows can see (HCA's is sized for the longest context): rows whose visible
    entries are a prefix of 0, 1, 17 or all slots, one whose only visible entry is the last slot, one with hidden
    slots inside its prefix. The kernel walks each row's chunks up to its last visible entry; splits past it
    store an empty state. Same result as the reference and the contract, with the scan for that entry in steps
    of 16 slots (several steps) and of ENT_SCAN."""
    monkeypatch.setattr(sa, "ENT_SCAN", ent_scan)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    args = make_case(gen, B=6, n=1, starts=(3, 9, 30, 0, 12, 41), K=120, n_entries=150)
    rows = torch.randint(0, 150, (6, 120), generator=gen)
    for r, visible in enumerate((0, 1, 17, 120)):
        rows[r, visible:] = -1
    rows[4, :-1] = -1
    rows[5, 40:] = -1
    rows[5, torch.randperm(40, generator=gen)[:15]] = -1
    args["entry_rows"] = rows
    ref = sa.fused_attention_reference(*call(args))
    got = sa._launch(*call(args), splits=splits, block_n=16)
    assert torch.isfinite(got).all() and (got - ref).abs().max().item() < TOL
    assert (ref.double() - brute_force(*call(args))).abs().max().item() < TOL


@pytest.mark.parametrize("variant", ["no_entries", "k0", "all_hidden"])
def test_kernel_sliding_only_and_empty_entries(variant):
    gen = torch.Generator().manual_seed(3)
    args = make_case(gen, B=2, all_hidden=variant == "all_hidden")
    if variant == "no_entries":
        args.update(entries=None, entry_rows=None)
    elif variant == "k0":
        args.update(entry_rows=torch.empty(args["q"].shape[0], 0, dtype=torch.long))
    ref = sa.fused_attention_reference(*call(args))
    sliding = sa.fused_attention_reference(*call(args, entries=None, entry_rows=None))
    # no visible entry: only the window counts. Equal up to rounding, not bitwise: the softmax denominator sums a
    # longer row (its -inf columns add exact zeros, but a vectorised reduction groups the other terms differently)
    assert (ref - sliding).abs().max().item() < 1e-6
    got = sa.fused_attention(*call(args), backend="triton")
    assert (got - ref).abs().max().item() < TOL
    got = sa._launch(*call(args), splits=2)
    assert (got - ref).abs().max().item() < TOL


@pytest.mark.parametrize("sink", [1e4, -1e4, float("-inf")])
def test_kernel_extreme_sinks(sink):
    """A huge sink takes all the probability (output 0); a very negative or -inf one takes none."""
    gen = torch.Generator().manual_seed(4)
    args = make_case(gen, B=2, n=2)
    args["sinks"] = torch.full_like(args["sinks"], sink)
    ref = sa.fused_attention_reference(*call(args))
    for splits in (1, 3):
        got = sa._launch(*call(args), splits=splits)
        assert torch.isfinite(got).all() and (got - ref).abs().max().item() < TOL
    if sink > 0:
        assert ref.abs().max().item() == 0
    else:
        assert ref.abs().mean().item() > 1e-2


def test_index_helpers():
    rows = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    pos = torch.tensor([0, 1, 2, 6, 7, 8])  # request 0 at 0..2, request 1 at 6..8
    got = sa.hca_entry_rows(rows, pos, 3, 2)  # visible: w < (t + 1) // 2
    assert got.tolist() == [
        [-1] * 4,
        [10, -1, -1, -1],
        [10, -1, -1, -1],
        [20, 21, 22, -1],
        [20, 21, 22, 23],
        [20, 21, 22, 23],
    ]
    picked = torch.tensor([[2, -1], [0, 1], [3, 3], [-1, -1], [1, 0], [2, 3]])
    assert sa.picked_entry_rows(rows, picked, 3).tolist() == [
        [12, -1],
        [10, 11],
        [13, 13],
        [-1, -1],
        [21, 20],
        [22, 23],
    ]


def test_dispatch_and_guards():
    gen = torch.Generator().manual_seed(5)
    args = make_case(gen, B=1, n=1)
    ref = sa.fused_attention_reference(*call(args))
    assert torch.equal(sa.fused_attention(*call(args), backend="reference"), ref)
    assert torch.equal(sa.fused_attention(*call(args)), ref)  # auto on CPU tensors: the reference
    with pytest.raises(ValueError):
        sa.fused_attention(*call(args, n=2))  # 1 row is not a whole request of 2 rows
    with pytest.raises(ValueError):
        sa.fused_attention(*call(args, entries=args["entries"].double()), backend="triton")  # mixed dtypes


# ---- against the engine's _attend ---------------------------------------------------------------------------


def _fused_inputs(attn, q, kv, group, batch, pool, idx_q):
    """fused_attention's arguments for one engine group (rows flattened request-major, as the static step has them)."""
    n = group.n
    flat = group.rows.reshape(-1)
    pos = group.pos.reshape(-1)
    entries = entry_rows = None
    if attn.layer_type != SLIDING:
        rows = entry_index(group, batch.pools, attn.ratio)[0]
        entries = pool.compressor.entries
        if attn.layer_type == CSA:
            picked = attn.indexer.select(*idx_q, group, batch.pools, pool.indexer)
            entry_rows = sa.picked_entry_rows(rows, picked, n)
        else:
            entry_rows = sa.hca_entry_rows(rows, pos, n, attn.ratio)
    return (
        q[flat],
        kv[flat],
        pool.window,
        batch.pools.window_ring,
        attn.window,
        pos,
        group.slots.repeat_interleave(n),
        n,
        entries,
        entry_rows,
        attn.sinks,
        attn.head_dim**-0.5,
    )


def test_matches_engine_attend(tiny_runner, monkeypatch):
    """A real tiny-model runner: prompts of 59 (ring of 55 wraps), 3 (window partly before position 0) and 30 tokens,
    then a decode forward (n=1) and a 6-row verify forward (rows cross the forward boundary). At every layer's
    `_attend` (sliding, CSA, HCA) the kernel and the reference equal the engine's output."""
    runner = tiny_runner(max_seqs=4, max_seq_len=96)
    gen = torch.Generator().manual_seed(6)
    seqs = [runner.allocate() for _ in range(3)]
    for s, length in zip(seqs, (59, 3, 30)):
        runner.forward([s], [torch.randint(2, 500, (length,), generator=gen).tolist()])

    seen = []
    original = Attention._attend

    def checked(self, q, kv, group, batch, pool, idx_q):
        out = original(self, q, kv, group, batch, pool, idx_q)
        want = out.reshape(group.size * group.n, self.heads, self.head_dim)
        args = _fused_inputs(self, q, kv, group, batch, pool, idx_q)
        got = sa.fused_attention(*args, backend="triton")
        ref = sa.fused_attention_reference(*args)
        seen.append((self.layer_type, group.n, (got - want).abs().max().item(), (ref - want).abs().max().item()))
        if args[9] is not None:  # the entry part is live: some visible entries, and (CSA, HCA) some hidden
            assert (args[9] >= 0).any()
        return out

    monkeypatch.setattr(Attention, "_attend", checked)
    runner.forward(seqs, [[5], [6], [7]])
    runner.forward(seqs, torch.randint(2, 500, (3, 6), generator=gen).tolist())
    kinds = {(kind, n) for kind, n, _, _ in seen}
    assert {(t, n) for t in (SLIDING, CSA, HCA) for n in (1, 6)} <= kinds
    for kind, n, kernel_err, ref_err in seen:
        assert kernel_err < TOL and ref_err < TOL, (kind, n, kernel_err, ref_err)


@pytest.mark.parametrize("n", [1, 3])
def test_invariant_plan_row_is_bitwise_the_same_in_any_batch(n):
    """`invariant=True` (--deterministic): the rows of one request are bitwise the same alone and at a random place
    among 2 or 5 requests (always with the neighbour whose q and kv are NaN), with entry rows padded by 130 or 1100
    more -1 columns (more splits, a wider merge), and close to the reference. 520 entry rows: two 512-key splits and
    the merge."""
    gen = torch.Generator().manual_seed(21 + n)
    B = 64
    args = make_case(gen, B=B, n=n, starts=torch.randint(0, 60, (B,), generator=gen).tolist(), K=520, n_entries=600)
    args["q"][n : 2 * n] = float("nan")
    args["kv"][n : 2 * n] = float("nan")
    target = 5

    def rows_of(requests):
        return torch.cat([torch.arange(r * n, (r + 1) * n) for r in requests])

    def run(requests, pad=0):
        idx = rows_of(requests)
        sub = {k: args[k][idx] for k in ("q", "kv", "pos", "slot", "entry_rows")}
        if pad:
            sub["entry_rows"] = torch.cat([sub["entry_rows"], torch.full((len(idx), pad), -1)], dim=1)
        out = sa.fused_attention(*call(args, **sub), backend="triton", invariant=True)
        at = requests.index(target)
        return out[at * n : (at + 1) * n]

    alone = run([target])
    ref = sa.fused_attention_reference(*call(args))[rows_of([target])]
    assert (alone - ref).abs().max().item() < TOL
    for pad in (130, 1100):  # one more split (S_PAD 4), and S_PAD 8: the merge adds the empty splits last
        assert torch.equal(run([target], pad=pad), alone), f"pad {pad}"
    # The invariant plan does not look at T (test_invariant_plan_is_fixed_by_the_key_count_only), and the launch
    # takes one program per row, split and head block: a larger batch (9 requests, or all 64) only adds programs
    # and neighbours. 5 requests put the target at a random place among several. Request 1 (NaN q and kv) is in
    # every batch.
    for batch in (2, 5):
        others = [1] + [r for r in torch.randperm(B, generator=gen).tolist() if r not in (1, target)][: batch - 2]
        requests = others + [target]
        requests = [requests[i] for i in torch.randperm(batch, generator=gen).tolist()]
        assert torch.equal(run(requests), alone), f"batch {batch}"


def test_invariant_plan_is_fixed_by_the_key_count_only():
    """The invariant launch shape does not look at T: 16-head blocks, INVARIANT_SPLIT_KEYS per split."""
    plans = [sa.plan(T, 64, 512, 128, 600, torch.device("cpu"), invariant=True) for T in (1, 6, 64, 4096)]
    assert all(p == plans[0] for p in plans)
    assert plans[0]["BLOCK_H"] == 16 and plans[0]["per_split"] * plans[0]["BLOCK_N"] == sa.INVARIANT_SPLIT_KEYS


def test_invariant_merge_sums_the_splits_in_order_whatever_the_padding():
    """Four live 512-key splits, then 600 more hidden entry columns (a fifth split, all masked): the merge's lanes go
    from 4 to 8, and a lane reduction pairs the four states differently (the interpreter's numpy sum does: one
    after another below 8 lanes, in pairs from 8). `invariant` sums them in split order: bitwise the same."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    # two rows (each has its own four splits and merge; two more rows only added programs)
    args = make_case(gen, B=2, n=1, H=8, starts=[2000, 1500], K=1600, n_entries=1700)
    assert sa.plan(2, 8, 64, 8, 1600, torch.device("cpu"), esize=4, invariant=True)["splits"] == 4
    padded = torch.cat([args["entry_rows"], torch.full((2, 600), -1)], dim=1)
    assert sa.plan(2, 8, 64, 8, 2200, torch.device("cpu"), esize=4, invariant=True)["splits"] == 5
    alone = sa.fused_attention(*call(args), backend="triton", invariant=True)
    assert torch.equal(sa.fused_attention(*call(args, entry_rows=padded), backend="triton", invariant=True), alone)
    assert (alone - sa.fused_attention_reference(*call(args))).abs().max().item() < TOL
