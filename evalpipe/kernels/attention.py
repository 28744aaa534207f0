"""The attention core of a decode/verify step (`Attention._attend`) as one split-KV Triton kernel (+ a tiny combine).

`_attend` spends ~20 launches per layer on a group: gather window keys from the ring, cat with this forward's rows,
unfold, two logit matmuls, scale, masks, sinks, cat, amax, softmax, cast, two PV matmuls and an add. Here every
query row gathers its own keys by address (ring cell, this forward's kv row, or compressed-entry pool row) inside
the kernel, so the step launches one kernel (`splits == 1`) or two (split-KV: partial softmax states, then a merge).

Keys of the query at row i (request i // n, first row f = i - i % n, position p = pos[i]):
  window  positions p-W+1 .. p that are >= 0; a position k >= pos[f] is kv[f + k - pos[f]] (this forward, not yet
          in the ring), an earlier one is window_ring[slot * ring_size + k % ring_size];
  entries entries[entry_rows[i, j]] for entry_rows[i, j] >= 0 (-1 = hidden or empty);
  sink    one extra logit per head whose probability is dropped.
K = V (one shared head); all H query heads of a row read the same keys, so a program takes a block of heads as the
M side of the two tensor-core dots.

Numerics: logits and softmax in fp32 (dot with fp32 accumulation, times `scale`); probabilities are rounded to the
key dtype before the PV dot, as `_attend` does (probs.to(win.dtype)); output in q.dtype. Differences from `_attend`
(bf16 only; in fp32 both agree to ~1e-6): `_attend` rounds the logits q.k and (q.k)*scale to bf16 and sums the
window and entry PV products as two bf16 results; the kernel keeps logits in fp32, rounds the unnormalised
probabilities exp(logit - running max of its split) instead of the normalised ones (flash-attention style; the sum
is kept in fp32), and rounds the output once. All of these are bf16-rounding-level differences (H200, production
shapes: kernel vs an fp32 reference <= 3.1e-3 relative, `_attend` vs the same reference up to 1.9e-2).

Launch (`plan`): programs (row, key split, head block), 64-key chunks, 16- or 32-head blocks; with more than one
split a merge kernel combines the partial (max, sum, output) states. The entry axis is sized for the longest
context (HCA: every entry a request could reach), so a program first scans its row's entry slots and stops after
the last visible one; a split that starts past it stores an empty state. The key rows are gathered through element
offsets from one base pointer with an 8-element alignment hint: that is what lets Triton vectorise and
software-pipeline the gather (checked offline with ptxas for sm_90a: no spills, cp.async row loads, 199-240
registers at the production shapes). The first H200 measurement (benchmarks/kernels/step_attention_gpu.py) was of an
earlier
version that selected between three base pointers, which compiled to scalar, unpipelined 2-byte loads: even so
1.2x-2.8x faster than `_attend` with 1-2 kernels instead of 14-28.

`StaticModel.attention` (engine/static/model.py) is the caller, after the q/kv RoPE and the compressors and before
the ring stores: sliding layers pass entries None; HCA layers the rows of every entry with -1 where not yet visible
(`hca_entry_rows`, computed once per step and ratio: `step_meta`); CSA layers the indexer's top-k pool rows
(`indexer.csa_select`, or the model's fused site `csa_rows` when built with sites). No per-layer preparation: sinks are
already float32 on the layer. `picked_entry_rows` maps the plain runner's `Indexer.select` picks the same way.
"""

from __future__ import annotations

import torch

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---- index helpers (device ops, no host reads) --------------------------------------------------------------


def hca_entry_rows(rows: torch.Tensor, pos: torch.Tensor, n: int, ratio: int) -> torch.Tensor:
    """[T, E] pool rows of entries 0..E-1 for each query row (request b's rows[b] repeated for its n rows), -1 where
    entry w is not visible to the query at position t: w >= (t + 1) // ratio (HCA's "all visible entries")."""
    B, E = rows.shape
    per_row = rows[:, None, :].expand(B, n, E).reshape(B * n, E)
    visible = torch.arange(E, device=rows.device)[None] < ((pos + 1) // ratio)[:, None]
    return torch.where(visible, per_row, torch.full_like(per_row, -1))


def picked_entry_rows(rows: torch.Tensor, picked: torch.Tensor, n: int) -> torch.Tensor:
    """[T, k] pool rows of the indexer's picks (CSA): `picked` [T, k] (or [B, n, k]) logical entry indices of each
    query row, -1 = none, mapped through its request's entry rows `rows` [B, E] (entry_index(...)[0])."""
    B = rows.shape[0]
    picked = picked.reshape(B * n, -1)
    b = torch.arange(B * n, device=rows.device)[:, None] // n
    return torch.where(picked >= 0, rows[b, picked.clamp(min=0)], torch.full_like(picked, -1))


def _check(q, kv, window_ring, ring_size, window, pos, slot, n, entries, entry_rows, sinks):
    if q.dim() != 3 or kv.dim() != 2 or kv.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"q must be [T, H, D] and kv [T, D], got {tuple(q.shape)} and {tuple(kv.shape)}")
    T, H, D = q.shape
    if n < 1 or T % n:
        raise ValueError(f"T = {T} rows is not a whole number of requests of n = {n} rows")
    if window_ring.dim() != 2 or window_ring.shape[1] != D or window < 1 or ring_size < 1:
        raise ValueError(f"window_ring must be [S * ring_size, {D}], got {tuple(window_ring.shape)}")
    if pos.shape != (T,) or slot.shape != (T,) or sinks.shape != (H,):
        raise ValueError(
            f"pos, slot must be [{T}] and sinks [{H}], got {tuple(pos.shape)}, {tuple(slot.shape)}, "
            f"{tuple(sinks.shape)}"
        )
    if entries is not None and entry_rows is not None:
        if entries.dim() != 2 or entries.shape[1] != D or entry_rows.dim() != 2 or entry_rows.shape[0] != T:
            raise ValueError(
                f"entries must be [N, {D}] and entry_rows [{T}, K], got {tuple(entries.shape)} and "
                f"{tuple(entry_rows.shape)}"
            )


def _has_entries(entries, entry_rows) -> bool:
    return entries is not None and entry_rows is not None and entry_rows.shape[1] > 0


# ---- reference ------------------------------------------------------------------------------------------------


def fused_attention_reference(q, kv, window_ring, ring_size, window, pos, slot, n, entries, entry_rows, sinks, scale):
    """`_attend`'s op chain on flat rows (same roundings): window keys gathered per row, logits in q's dtype times
    scale, -inf masks, sinks column, fp32 softmax, probabilities cast to the key dtype, two PV matmuls. Fixed shapes
    and device ops only."""
    _check(q, kv, window_ring, ring_size, window, pos, slot, n, entries, entry_rows, sinks)
    T, H, D = q.shape
    pos, slot = pos.long(), slot.long()
    i = torch.arange(T, device=q.device)
    first = i - i % n
    first_pos = pos[first][:, None]
    kpos = pos[:, None] - (window - 1) + torch.arange(window, device=q.device)[None]  # [T, W]
    kc = kpos.clamp(min=0)
    new = kc >= first_pos
    cells = slot[:, None] * ring_size + kc % ring_size
    new_rows = (first[:, None] + kc - first_pos).clamp(0, T - 1)
    win = torch.where(new[..., None], kv[new_rows], window_ring[cells])  # [T, W, D]
    logits = [(torch.matmul(q, win.transpose(1, 2)) * scale).masked_fill_((kpos < 0)[:, None], float("-inf"))]
    comp = None
    if _has_entries(entries, entry_rows):
        er = entry_rows.long()
        comp = entries[er.clamp(min=0)]  # [T, K, D]
        cl = torch.matmul(q, comp.transpose(1, 2)) * scale
        logits.append(cl.masked_fill_((er < 0)[:, None], float("-inf")))
    logits.append(sinks.float().expand(T, H).unsqueeze(-1))
    combined = torch.cat(logits, dim=-1)
    probs = (combined - combined.amax(dim=-1, keepdim=True)).softmax(dim=-1)
    if probs.dtype != win.dtype:
        probs = probs.to(win.dtype)
    out = torch.matmul(probs[..., :window], win)
    if comp is not None:
        out = out + torch.matmul(probs[..., window:-1], comp)
    return out.to(q.dtype)


# ---- kernels (built on first use by `jit`) ---------------------------------------------------------------

if tl is not None:

    def _step_attention_kernel(
        q_ptr,
        ring_ptr,
        kv_off,
        ent_off,
        rows_ptr,
        pos_ptr,
        slot_ptr,
        sinks_ptr,
        out_ptr,
        po_ptr,
        pm_ptr,
        pl_ptr,
        H,
        n,
        ring_size,
        window,
        K,
        scale,
        chunks_per_split,
        total_chunks,
        stride_qt,
        stride_qh,
        stride_kv,
        stride_ring,
        stride_ent,
        stride_rt,
        stride_rk,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        W_CHUNKS: tl.constexpr,
        HAS_ENT: tl.constexpr,
        ENT_SCAN: tl.constexpr,
        SPLIT: tl.constexpr,
        IEEE: tl.constexpr,
        ALIGNED: tl.constexpr,
    ):
        # every key row is addressed as an element offset from ring_ptr (kv rows at kv_off, entries at ent_off):
        # one base pointer keeps the gather's rows analysable, so with ALIGNED (all offsets multiples of 8 elements)
        # the row loads are 16-byte vectors and software-pipelined (cp.async); a select between three base
        # pointers compiled to scalar, unpipelined loads
        i = tl.program_id(0)
        s = tl.program_id(1)
        hb = tl.program_id(2)
        S = tl.num_programs(1)
        i64 = i.to(tl.int64)
        p = tl.load(pos_ptr + i).to(tl.int64)
        first = i64 - i64 % n
        first_pos = tl.load(pos_ptr + first).to(tl.int64)
        slot = tl.load(slot_ptr + i).to(tl.int64)

        hs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = hs < H
        ds = tl.arange(0, BLOCK_D)
        dm = ds < D
        q = tl.load(
            q_ptr + i64 * stride_qt + hs[:, None] * stride_qh + ds[None, :], mask=hm[:, None] & dm[None, :], other=0.0
        )
        # the sink is one more logit of every head: split 0 starts its running softmax from it (counted once)
        sink = tl.load(sinks_ptr + hs, mask=hm, other=0.0).to(tl.float32)
        m0 = tl.maximum(sink, -1.0e30)  # finite floor: no inf - inf
        m_i = tl.where(s == 0, m0, -1.0e30)
        l_i = tl.where(s == 0, tl.exp(sink - m0), 0.0)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

        js = tl.arange(0, BLOCK_N)
        c_lo = s * chunks_per_split
        c_hi = tl.minimum(c_lo + chunks_per_split, total_chunks)
        if HAS_ENT:
            # the entry axis is sized for the longest context (HCA: every entry a request can reach): stop after
            # this row's last visible entry. The chunks skipped are all masked, and one would leave every running
            # state as it was (alpha 1, no probability), so skipping them changes no bit and no batch-invariance
            last = tl.full([], -1, tl.int32)
            for e0 in range(0, K, ENT_SCAN):
                es = e0 + tl.arange(0, ENT_SCAN)
                er_scan = tl.load(rows_ptr + i64 * stride_rt + es * stride_rk, mask=es < K, other=-1)
                last = tl.maximum(last, tl.max(tl.where(er_scan >= 0, es, -1), axis=0))
            c_hi = tl.minimum(c_hi, W_CHUNKS + (last + BLOCK_N) // BLOCK_N)
        for c in range(c_lo, c_hi):
            # virtual key axis: W_CHUNKS * BLOCK_N window slots, then the K entry slots
            j = c * BLOCK_N + js
            kpos = p - window + 1 + j
            win_ok = (j < window) & (kpos >= 0)
            kc = tl.maximum(kpos, 0)
            new = win_ok & (kc >= first_pos)
            cell = slot * ring_size + kc % ring_size
            off = tl.where(new, kv_off + (first + kc - first_pos) * stride_kv, cell * stride_ring)
            valid = win_ok
            if HAS_ENT:
                e = j - W_CHUNKS * BLOCK_N
                er = tl.load(rows_ptr + i64 * stride_rt + e * stride_rk, mask=(e >= 0) & (e < K), other=-1)
                er = er.to(tl.int64)
                ent_ok = er >= 0
                off = tl.where(ent_ok, ent_off + tl.maximum(er, 0) * stride_ent, off)
                valid = valid | ent_ok
            if ALIGNED:
                off = tl.multiple_of(off, 8)
            kt = tl.load(ring_ptr + off[:, None] + ds[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(kt), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(kt))
            qk = tl.where(valid[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp(m_i - m_new)
            pr = tl.exp(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, axis=1)
            if IEEE:
                pv = tl.dot(pr.to(kt.dtype), kt, input_precision="ieee")
            else:
                pv = tl.dot(pr.to(kt.dtype), kt)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SPLIT:  # partial state of this split: running max, sum and unnormalised output
            base = (i64 * S + s) * H + hs
            tl.store(pm_ptr + base, m_i, mask=hm)
            tl.store(pl_ptr + base, l_i, mask=hm)
            tl.store(po_ptr + base[:, None] * D + ds[None, :], acc, mask=hm[:, None] & dm[None, :])
        else:
            out = acc / l_i[:, None]
            tl.store(
                out_ptr + (i64 * H + hs[:, None]) * D + ds[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=hm[:, None] & dm[None, :],
            )

    def _step_attention_combine_kernel(
        po_ptr,
        pm_ptr,
        pl_ptr,
        out_ptr,
        H,
        S,
        D: tl.constexpr,
        S_PAD: tl.constexpr,
        BLOCK_D: tl.constexpr,
        ORDERED: tl.constexpr,
    ):
        # ORDERED (invariant): the splits summed one after another in split order, so a row's trailing all-masked
        # splits (a longer entry axis beside it) add exact zeros at the end; a tl.sum over S_PAD lanes may pair the
        # splits differently as S_PAD grows
        i = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        ss = tl.arange(0, S_PAD)
        sm = ss < S
        base = (i * S + ss) * H + h
        m = tl.load(pm_ptr + base, mask=sm, other=-1.0e30)
        big = tl.max(m, axis=0)  # a maximum: the same in any order
        ds = tl.arange(0, BLOCK_D)
        if ORDERED:
            den = tl.full([], 0.0, tl.float32)
            for s in range(0, S):
                b = (i * S + s) * H + h
                den += tl.exp(tl.load(pm_ptr + b) - big) * tl.load(pl_ptr + b)
            for d0 in range(0, D, BLOCK_D):
                dm = d0 + ds < D
                y = tl.zeros([BLOCK_D], dtype=tl.float32)
                for s in range(0, S):
                    b = (i * S + s) * H + h
                    ws = tl.exp(tl.load(pm_ptr + b) - big) / den
                    y += ws * tl.load(po_ptr + b * D + d0 + ds, mask=dm, other=0.0)
                tl.store(out_ptr + (i * H + h) * D + d0 + ds, y.to(out_ptr.dtype.element_ty), mask=dm)
        else:
            w = tl.where(sm, tl.exp(m - big), 0.0)
            den = tl.sum(w * tl.load(pl_ptr + base, mask=sm, other=0.0), axis=0)
            w = w / den
            for d0 in range(0, D, BLOCK_D):
                dm = d0 + ds < D
                o = tl.load(po_ptr + base[:, None] * D + d0 + ds[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
                y = tl.sum(w[:, None] * o, axis=0)
                tl.store(out_ptr + (i * H + h) * D + d0 + ds, y.to(out_ptr.dtype.element_ty), mask=dm)


# ---- launch ---------------------------------------------------------------------------------------------------

# integer arguments that change with every prompt chunk (rows per sequence, entry count, key chunks, where kv
# sits in the pool): not specialised (see kernels._backend.jit); alignment is passed explicitly as ALIGNED
ATTENTION_VARYING = ("kv_off", "ent_off", "n", "K", "chunks_per_split", "total_chunks", "stride_rt")


INVARIANT_SPLIT_KEYS = 512  # keys per split under `invariant` (a multiple of every BLOCK_N)
ENT_SCAN = 1024  # entry slots a program reads at once to find its row's last visible entry


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: few programs, but still a split path at small T


def plan(
    T: int,
    H: int,
    D: int,
    window: int,
    K: int,
    device: torch.device,
    *,
    esize: int = 2,
    splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    min_keys: int | None = None,
    invariant: bool = False,
) -> dict:
    """Launch shape from static sizes only (capture-safe). Each program is latency-bound (an index load, a dependent
    gather and two small dots per key chunk), so the rule is: chunks of 64 keys, at most one wave of programs, each
    taking >= `min_keys` keys (a split writes an fp32 [H, D] partial). Heads go in blocks of 32 when T rows x key
    splits already fill the SMs (keys read once per row), else in blocks of 16 (twice the programs). Every split is
    non-empty. From an H200 sweep (32 x 512 heads, bf16; benchmarks/kernels/step_attention_gpu.py --sweep): 64-key
    chunks
    and 8 warps won at every shape (bf16; fp32 rows of 512 take 32-key chunks: shared memory); 16-head blocks at T=1
    and for sliding-only layers, 32-head blocks with 4 splits
    at T=32 (CSA, HCA). Keyword overrides are for that sweep.

    `invariant` (--deterministic): 16-head blocks and splits of INVARIANT_SPLIT_KEYS keys whatever T, so a row's
    keys meet the same chunks, splits and merge in every batch, chunking and verify width; entry padding (a longer
    K) only adds trailing all-masked chunks and splits, which add exact zeros."""
    sms = _sm_count(device)
    keys = window + K
    block_n = block_n or (64 if D * esize <= 1024 else 32)  # a 64 KiB tile per pipeline stage at most
    if invariant:
        block_h = 16
    block_h = block_h or (32 if T * triton.cdiv(keys, 128) >= sms else 16)
    block_h = max(16, min(block_h, triton.next_power_of_2(H)))
    head_blocks = triton.cdiv(H, block_h)
    w_chunks = triton.cdiv(window, block_n)
    total = w_chunks + triton.cdiv(K, block_n)
    if invariant:
        splits = triton.cdiv(total, INVARIANT_SPLIT_KEYS // block_n)
    if splits is None:
        min_keys = min_keys or (128 if block_h >= 32 else 64)
        splits = min(keys // min_keys, sms // (T * head_blocks))
    splits = max(1, min(int(splits), total))
    per_split = INVARIANT_SPLIT_KEYS // block_n if invariant else triton.cdiv(total, splits)
    splits = triton.cdiv(total, per_split)
    return dict(
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        head_blocks=head_blocks,
        W_CHUNKS=w_chunks,
        total=total,
        splits=splits,
        per_split=per_split,
        num_warps=num_warps or (4 if D <= 128 else 8),
        num_stages=num_stages or 2,
    )


def _launch(
    q,
    kv,
    window_ring,
    ring_size,
    window,
    pos,
    slot,
    n,
    entries,
    entry_rows,
    sinks,
    scale,
    splits: int | None = None,
    invariant: bool = False,
    **overrides,
) -> torch.Tensor:
    T, H, D = q.shape
    has_ent = _has_entries(entries, entry_rows)
    K = entry_rows.shape[1] if has_ent else 0
    if q.stride(2) != 1:
        q = q.contiguous()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    pos, slot, sinks = pos.contiguous(), slot.contiguous(), sinks.contiguous()  # read as flat arrays; no-ops
    cfg = plan(T, H, D, window, K, q.device, esize=q.element_size(), splits=splits, invariant=invariant, **overrides)
    S = cfg["splits"]
    merge = S > 1 or invariant  # invariant: always the merge's arithmetic, however many splits the keys fill
    out = torch.empty(T, H, D, device=q.device, dtype=q.dtype)
    if has_ent:
        ent, rows = entries, entry_rows
    else:  # never read (HAS_ENT off): any tensors of the right kind
        ent, rows = window_ring, pos[:, None]
    kv_off, ent_off, aligned = _ring_offsets(window_ring, kv, ent)
    po, pm, pl = _split_partials(T, S, H, D, q.device) if merge else (out, out, out)
    jit(_step_attention_kernel, ATTENTION_VARYING)[(T, S, cfg["head_blocks"])](
        q,
        window_ring,
        kv_off,
        ent_off,
        rows,
        pos,
        slot,
        sinks,
        out,
        po,
        pm,
        pl,
        H,
        n,
        ring_size,
        window,
        K,
        float(scale),
        cfg["per_split"],
        cfg["total"],
        q.stride(0),
        q.stride(1),
        kv.stride(0),
        window_ring.stride(0),
        ent.stride(0),
        rows.stride(0),
        rows.stride(1),
        D=D,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_H=cfg["BLOCK_H"],
        BLOCK_N=cfg["BLOCK_N"],
        W_CHUNKS=cfg["W_CHUNKS"],
        HAS_ENT=has_ent,
        ENT_SCAN=ENT_SCAN,
        SPLIT=merge,
        IEEE=q.dtype == torch.float32,
        ALIGNED=aligned,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    if merge:
        _combine_splits(po, pm, pl, out, ordered=invariant)
    return out


def _ring_offsets(window_ring, kv, ent) -> tuple[int, int, bool]:
    """kv's and ent's element offsets from window_ring (the kernel addresses all three from its pointer) and
    whether every base and row stride allows aligned loads."""
    esize = window_ring.element_size()
    kv_off = (kv.data_ptr() - window_ring.data_ptr()) // esize  # same dtype: exact
    ent_off = (ent.data_ptr() - window_ring.data_ptr()) // esize
    aligned = window_ring.data_ptr() % 16 == 0 and all(
        x % 8 == 0 for x in (kv_off, ent_off, kv.stride(0), window_ring.stride(0), ent.stride(0))
    )
    return kv_off, ent_off, aligned


def _split_partials(T: int, S: int, H: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 buffers for each of the S key splits' partial output, running max and running sum."""
    po = torch.empty(T, S, H, D, device=device, dtype=torch.float32)
    pm = torch.empty(T, S, H, device=device, dtype=torch.float32)
    pl = torch.empty(T, S, H, device=device, dtype=torch.float32)
    return po, pm, pl


def _combine_splits(po, pm, pl, out, *, ordered: bool) -> None:
    """Merges the key splits' partials into `out` [T, H, D]."""
    T, S, H, D = po.shape
    jit(_step_attention_combine_kernel)[(T, H)](
        po,
        pm,
        pl,
        out,
        H,
        S,
        D=D,
        S_PAD=triton.next_power_of_2(S),
        BLOCK_D=min(128, triton.next_power_of_2(D)),
        ORDERED=ordered,
        num_warps=4,
    )


def _guard(q, kv, window_ring, entries, sinks) -> bool:
    dtypes = {q.dtype, kv.dtype, window_ring.dtype} | ({entries.dtype} if entries is not None else set())
    return (
        len(dtypes) == 1
        and q.dtype in FLOAT_DTYPES
        and sinks.dtype == torch.float32
        and window_ring.stride(1) == 1
        and (entries is None or entries.stride(1) == 1)
    )


def fused_attention_applies(backend: str, q, kv, window_ring, entries, sinks) -> bool:
    """Whether `fused_attention` would launch the kernel for these tensors under `backend` (callers that keep a
    chain of their own for the other case ask first)."""
    tensors = [q, kv, window_ring, sinks] + ([entries] if entries is not None else [])
    return use_triton(backend, tensors, _guard(q, kv, window_ring, entries, sinks))


def fused_attention(
    q,
    kv,
    window_ring,
    ring_size,
    window,
    pos,
    slot,
    n,
    entries,
    entry_rows,
    sinks,
    scale,
    *,
    backend="auto",
    invariant: bool = False,
):
    """[T, H, D] attention output of T = B * n query rows over their sliding window (ring + this forward's kv rows)
    and their compressed entries, with per-head sinks (see the module docstring). One Triton kernel (plus a merge
    kernel when the key axis is split across programs) on CUDA; `fused_attention_reference` elsewhere.
    `invariant`: the launch `plan(invariant=True)` (a row's result independent of T, n and entry padding)."""
    _check(q, kv, window_ring, ring_size, window, pos, slot, n, entries, entry_rows, sinks)
    tensors = [q, kv, window_ring, pos, slot, sinks] + (
        [entries, entry_rows] if _has_entries(entries, entry_rows) else []
    )
    if not use_triton(backend, tensors, _guard(q, kv, window_ring, entries, sinks)):
        return fused_attention_reference(
            q, kv, window_ring, ring_size, window, pos, slot, n, entries, entry_rows, sinks, scale
        )
    return _launch(
        q, kv, window_ring, ring_size, window, pos, slot, n, entries, entry_rows, sinks, scale, invariant=invariant
    )
