"""ratio2_compress_verify: the Triton kernel (CPU interpreter) against the reference chain, the single-row-launch and
rollback invariants, and the reference against transformers' DeepseekV4HCACompressor at compress rate 2."""

from __future__ import annotations

import pytest
import torch

from evalpipe.kernels._backend import use_triton
from evalpipe.kernels.ratio2_compress_verify import ratio2_compress_verify, ratio2_compress_verify_reference

HD, ROPE, PAGE, SLOTS = 64, 16, 4, 8  # head dim, rope dims, page size, request slots
MAX_POS = 96


class C2State:
    """Weights, RoPE tables and the mutable ring/pool of one compressed layer, seeded randomly (never zeros)."""

    def __init__(self, seed: int, ring_size: int, dtype=torch.bfloat16, pool_dtype=torch.bfloat16):
        g = torch.Generator().manual_seed(seed)
        self.ring_size, self.dtype = ring_size, dtype
        self.bias = torch.randn(2, HD, generator=g)
        self.norm_w = torch.rand(HD, generator=g) + 0.5
        angles = torch.arange(MAX_POS)[:, None] * (0.3 ** torch.arange(ROPE // 2))[None]
        self.cos, self.sin = angles.cos().float(), angles.sin().float()
        self.ring = torch.randn(SLOTS * ring_size, 2 * HD, generator=g).to(dtype)
        pages_per_req = (MAX_POS // 2 + PAGE - 1) // PAGE
        self.page_table = torch.randperm(SLOTS * pages_per_req + 3, generator=g)[: SLOTS * pages_per_req]
        self.page_table = self.page_table.view(SLOTS, pages_per_req).to(torch.int32)
        self.pool = torch.randn((SLOTS * pages_per_req + 3) * PAGE, HD, generator=g).to(pool_dtype)

    def clone(self) -> "C2State":
        other = object.__new__(C2State)
        other.__dict__ = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return other

    def launch(self, kv_gate, positions, req, valid, rows_per_request, backend="triton"):
        ratio2_compress_verify(
            kv_gate,
            positions,
            req,
            valid,
            self.bias,
            self.norm_w,
            1e-6,
            self.cos,
            self.sin,
            ROPE,
            self.ring,
            self.pool,
            self.page_table,
            PAGE,
            self.ring_size,
            rows_per_request,
            backend=backend,
        )

    def slot(self, req: int, pos: int) -> int:
        entry = pos // 2
        return int(self.page_table[req, entry // PAGE]) * PAGE + entry % PAGE


def make_batch(
    pos0: list[int], reqs: list[int], d: int, padded: list[bool], seed: int, dtype=torch.bfloat16, pos_dtype=torch.int64
):
    """Request-major verify rows; padded requests get position 0, a live request slot and valid = False."""
    g = torch.Generator().manual_seed(seed)
    kv_gate = torch.randn(len(pos0) * d, 2 * HD, generator=g).to(dtype)
    positions = torch.tensor([0 if p else s + j for s, p in zip(pos0, padded) for j in range(d)], dtype=pos_dtype)
    req = torch.tensor([r for r in reqs for _ in range(d)], dtype=pos_dtype)
    valid = torch.tensor([not p for p in padded for _ in range(d)])
    return kv_gate, positions, req, valid


def single_row_history(state: C2State, kv_gate, positions, req, valid, d: int, rows: range | None = None):
    """Decode the same rows one position at a time (D = 1 launches, every request in each launch)."""
    for j in rows if rows is not None else range(d):
        idx = torch.arange(j, kv_gate.shape[0], d)
        state.launch(kv_gate[idx], positions[idx], req[idx], valid[idx], 1)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str):
    assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), what


# (D, batch, padded requests, kv|gate dtype): subsample of {2, 5, 6, 9} x {1, 3, 8} x {0, 1}, never all padded;
# fp32 rows (ring fp32, bf16 pool) are the production layout, bf16 rows the model-dtype one
BF, F32 = torch.bfloat16, torch.float32
MATRIX = [
    (2, 1, 0, BF),
    (2, 8, 1, BF),
    (5, 3, 1, F32),
    (6, 1, 0, F32),
    (6, 3, 0, BF),
    (6, 8, 1, F32),
    (9, 3, 1, BF),
    (9, 1, 0, F32),
]


@pytest.mark.parametrize("d,batch,n_pad,dtype", MATRIX)
def test_triton_equals_reference_and_single_row_launches(d, batch, n_pad, dtype):
    ring = 1 << (d + 1).bit_length()  # the speculative ring width used by the engine (D 6 -> 8, 9 -> 16)
    ring = min(ring, 16)
    state = C2State(seed=d * 10 + batch, ring_size=ring, dtype=dtype)
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(batch))
    reqs = [int(slots[b % SLOTS]) for b in range(batch)]
    # block heads alternate parity; starts near multiples of the ring width so blocks wrap the ring
    pos0 = [ring * (2 + b % 3) - 3 + b for b in range(batch)]
    padded = [b >= batch - n_pad for b in range(batch)]
    kv_gate, positions, req, valid = make_batch(pos0, reqs, d, padded, seed=batch + d, dtype=dtype)

    fused, ref, single = state.clone(), state.clone(), state.clone()
    fused.launch(kv_gate, positions, req, valid, d, backend="triton")
    ref.launch(kv_gate, positions, req, valid, d, backend="reference")
    single_row_history(single, kv_gate, positions, req, valid, d)

    # interpreter: same fp32 op order and RNE rounding points as the reference -> bitwise equal
    assert_bitwise(fused.ring, ref.ring, "ring: triton vs reference")
    assert_bitwise(fused.pool, ref.pool, "pool: triton vs reference")
    assert_bitwise(fused.ring, single.ring, "ring: one D-row launch vs D single-row launches")
    assert_bitwise(fused.pool, single.pool, "pool: one D-row launch vs D single-row launches")

    # exactly the expected rows were written: even live rows park, odd live rows store; padding writes nothing
    ring_written, pool_written = set(), set()
    for row in range(kv_gate.shape[0]):
        if not valid[row]:
            continue
        p, r = int(positions[row]), int(req[row])
        if p % 2 == 0:
            ring_written.add(r * ring + p % ring)
            assert_bitwise(fused.ring[r * ring + p % ring], kv_gate[row], "parked row is a bit copy")
        else:
            pool_written.add(state.slot(r, p))
    for i in range(state.ring.shape[0]):
        if i not in ring_written:
            assert_bitwise(fused.ring[i], state.ring[i], f"ring row {i} must be untouched")
    for i in range(state.pool.shape[0]):
        changed = not torch.equal(fused.pool[i], state.pool[i])
        assert changed == (i in pool_written), f"pool slot {i}: changed={changed}"
    assert pool_written, "the case must store at least one entry"


def test_reference_equals_single_row_reference_launches():
    d, batch = 6, 3
    state = C2State(seed=3, ring_size=8)
    kv_gate, positions, req, valid = make_batch([29, 32, 7], [1, 3, 0], d, [False] * batch, seed=5)
    one, many = state.clone(), state.clone()
    one.launch(kv_gate, positions, req, valid, d, backend="reference")
    for j in range(d):
        idx = torch.arange(j, kv_gate.shape[0], d)
        many.launch(kv_gate[idx], positions[idx], req[idx], valid[idx], 1, backend="reference")
    assert_bitwise(one.ring, many.ring, "reference ring")
    assert_bitwise(one.pool, many.pool, "reference pool")


def test_only_odd_block_heads_read_the_ring():
    """Perturbing the ring slot each odd head reads changes exactly the heads' entries."""
    d = 6
    state = C2State(seed=11, ring_size=8)
    pos0, reqs = [31, 33, 39], [0, 2, 3]  # odd heads, one wrapping the ring
    kv_gate, positions, req, valid = make_batch(pos0, reqs, d, [False] * 3, seed=12)
    valid = valid.to(torch.int64) * 3  # integer flags: nonzero = live
    base, bumped = state.clone(), state.clone()
    for r, p in zip(reqs, pos0):
        bumped.ring[r * 8 + (p - 1) % 8] += 1.0
    base.launch(kv_gate, positions, req, valid, d)
    bumped.launch(kv_gate, positions, req, valid, d)
    heads = {state.slot(r, p) for r, p in zip(reqs, pos0)}
    others = [i for i in range(state.pool.shape[0]) if i not in heads]
    for s in heads:
        assert not torch.equal(base.pool[s], bumped.pool[s]), f"head entry {s} must depend on its ring slot"
    assert_bitwise(base.pool[others], bumped.pool[others], "non-head entries must not read the ring")


@pytest.mark.parametrize("pos_dtype,backend", [(torch.int32, "triton"), (torch.int64, "reference")])
def test_rejected_suffix_needs_no_undo(pos_dtype, backend):
    """Verify D rows, accept k, verify again at pos0 + k: equal to a history that only ever decoded accepted rows
    (single-row launches of the accepted rows, then the same second launch)."""
    d, ring = 6, 8
    state = C2State(seed=21, ring_size=ring)
    # both head parities, and each accept count flips them for the second launch; 31..36 wraps the 8-wide ring
    # (32.. wraps in the second launch from 3 accepted). Two requests: the kernel runs one program per row, so a
    # third one of a parity already there (45) only added interpreted programs
    pos0, reqs = [31, 32], [3, 1]
    kv1, positions1, req1, valid1 = make_batch(pos0, reqs, d, [False] * 2, seed=22, pos_dtype=pos_dtype)
    # the first verify launch and the accepted rows' single-row launches are the same for every accept count, so
    # each is run once: `verified` is the state after the first launch, `decoded` after the first `accepted` rows.
    # The second launch starts at 31 + k and 32 + k (8-wide ring: a wrap when it reaches 40): k 1 gives an even
    # (32..37) and an odd (33..38) head without a wrap, k 3 an even head without (34..39) and an odd head with one
    # (35..40), k 6 (nothing rejected) an odd (37..42) and an even (38..43) head with one. k 2, 4 and 5 repeat
    # those cases (each program handles its own row) with other rejected suffixes; only the single-row launches of
    # their accepted rows run, for the later k
    verified = state.clone()
    verified.launch(kv1, positions1, req1, valid1, d, backend=backend)
    decoded = state.clone()
    for accepted in range(1, d + 1):
        idx = torch.arange(accepted - 1, kv1.shape[0], d)
        decoded.launch(kv1[idx], positions1[idx], req1[idx], valid1[idx], 1, backend=backend)
        if accepted not in (1, 3, 6):
            continue
        kv2, positions2, req2, valid2 = make_batch(
            [p + accepted for p in pos0], reqs, d, [False] * 2, seed=23 + accepted, pos_dtype=pos_dtype
        )
        kv2 = -kv2  # flipped inputs for the second launch
        verify = verified.clone()
        verify.launch(kv2, positions2, req2, valid2, d, backend=backend)
        history = decoded.clone()
        history.launch(kv2, positions2, req2, valid2, d, backend=backend)
        assert_bitwise(verify.ring, history.ring, f"ring after accepting {accepted}")
        assert_bitwise(verify.pool, history.pool, f"pool after accepting {accepted}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("ring", [5, 6])
def test_ring_not_wider_than_rows_raises(backend, ring):
    state = C2State(seed=1, ring_size=ring)
    kv_gate, positions, req, valid = make_batch([10], [0], 6, [False], seed=2)
    before = state.clone()
    with pytest.raises(ValueError, match="must be wider than rows_per_request"):
        state.launch(kv_gate, positions, req, valid, 6, backend=backend)
    assert_bitwise(state.pool, before.pool, "nothing written on a rejected launch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_chain_matches_transformers_hca_compressor_rate_2(dtype):
    """Full sequence through transformers' compressor vs our per-launch chain (D = 3, ring 4) through the pool.

    Same rounding points as transformers in the projection's dtype, so the only freedom is fp32 ulps inside
    softmax (closed form vs the library kernel) and the mean. Tolerance: fp32 model 1e-5 (measured 3.6e-7);
    bf16 model one bf16 ulp, rtol 2^-7 (measured: bitwise equal).
    """
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HCACompressor

    torch.manual_seed(0)
    cfg = DeepseekV4Config(
        hidden_size=48,
        head_dim=HD,
        partial_rotary_factor=ROPE / HD,
        num_attention_heads=2,
        num_hidden_layers=2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 2},
    )
    comp = DeepseekV4HCACompressor(cfg)
    with torch.no_grad():
        comp.position_bias.normal_()
        comp.kv_norm.weight.uniform_(0.5, 1.5)
    comp.kv_proj.to(dtype), comp.gate_proj.to(dtype)
    batch, seq = 2, 18
    x = torch.randn(batch, seq, cfg.hidden_size).to(dtype)
    with torch.no_grad():
        expected, _ = comp(x, None, torch.arange(seq)[None].expand(batch, -1), None, 0)  # [B, 1, seq/2, HD]
        kv_gate = torch.cat([comp.kv_proj(x), comp.gate_proj(x)], dim=-1)  # [B, seq, 2*HD] in model dtype
        cos, sin = comp.rotary_emb(x, position_ids=torch.arange(seq)[None], layer_type="compress")
    # transformers rounds the tables to the model dtype before rotating; hand the kernel the same values in fp32
    cos, sin = cos[0].float(), sin[0].float()

    d, ring = 3, 4
    ring_buf = torch.randn(batch * ring, 2 * HD).to(dtype)
    pages = (seq // 2 + PAGE - 1) // PAGE
    pool = torch.zeros(batch * pages * PAGE, HD, dtype=dtype)
    page_table = torch.arange(batch * pages).view(batch, pages).to(torch.int32)
    for start in range(0, seq, d):
        rows = kv_gate[:, start : start + d].reshape(batch * d, 2 * HD)
        positions = torch.arange(start, start + d).repeat(batch)
        req = torch.arange(batch).repeat_interleave(d)
        ratio2_compress_verify_reference(
            rows,
            positions,
            req,
            torch.ones(batch * d, dtype=torch.bool),
            comp.position_bias.data,
            comp.kv_norm.weight.data,
            cfg.rms_norm_eps,
            cos,
            sin,
            ROPE,
            ring_buf,
            pool,
            page_table,
            PAGE,
            ring,
            d,
        )
    got = pool.view(batch, pages * PAGE, HD)[:, : seq // 2].float()
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-6, 2.0**-7)
    torch.testing.assert_close(got, expected[:, 0].float(), atol=atol, rtol=rtol)


def test_dispatch_rules(monkeypatch):
    state = C2State(seed=4, ring_size=8)
    kv_gate, positions, req, valid = make_batch([7, 12], [0, 1], 6, [False, False], seed=6)
    ref = state.clone()
    ref.launch(kv_gate, positions, req, valid, 6, backend="reference")

    # auto on CPU is the reference (the shared rule), and gives its bytes
    assert not use_triton("auto", [kv_gate, state.pool], True)
    auto = state.clone()
    auto.launch(kv_gate, positions, req, valid, 6, backend="auto")
    assert_bitwise(auto.pool, ref.pool, "auto on CPU")

    # an fp16 pool fails the kernel's guard: auto falls back, forced triton says why
    half = C2State(seed=4, ring_size=8, pool_dtype=torch.float16)
    half.launch(kv_gate, positions, req, valid, 6, backend="auto")
    with pytest.raises(ValueError, match="guard"):
        half.launch(kv_gate, positions, req, valid, 6, backend="triton")

    # forced triton on CPU without the interpreter is a clear error, not a crash inside Triton
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        state.clone().launch(kv_gate, positions, req, valid, 6, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        state.clone().launch(kv_gate, positions, req, valid, 6, backend="cuda")
