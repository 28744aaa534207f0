"""The lightning indexer on the CUDA-graph step: its scores and the CSA top-k, one kernel each.

The eager chain spends ~8 kernels on the scores (gather keys, cast, matmul, ReLU, scale, weight, sum, mask). Here:

- `indexer_scores(q, weight_logits, entries, rows, pos, n, ratio, softmax_scale, head_scale)` -> [T, E] float32:
  sum_h ReLU(q[t,h] . entries[rows[t // n, e]]) * softmax_scale * (weight_logits[t,h] * head_scale), and -inf
  where entry e is not causally visible (e >= (pos[t] + 1) // ratio) -- what `Indexer.scores` computes, masked the
  way `causal_topk` masks it.
- `csa_select(scores, rows, n, k)` -> [T, k] pool rows of each query's top-k entries (-1 = none): rank by (score
  descending, entry index ascending) -- `causal_topk`'s tie rule -- then map through the request's entry rows, in
  one kernel instead of a radix sort plus ~5 index ops: the (score, index) pairs packed into unique int64 keys, each
  entry's rank counted against all others by many programs in parallel (a one-program in-register bitonic sort of
  the same keys measured 37 us per call on the H200 at E = 1282, slower than torch's radix sort at 21 us).

Triton on CUDA, the reference (the engine's own ops) elsewhere; `backend="triton"` runs the kernel on the CPU under
TRITON_INTERPRET=1 (tests/kernels)."""

from __future__ import annotations

import torch

from evalpipe.kernels._backend import jit, use_triton

try:
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - triton is optional
    triton = tl = None


if tl is not None:

    def _indexer_scores_kernel(
        q_ptr,
        w_ptr,
        w_stride,
        ent_ptr,
        ent_stride,
        rows_ptr,
        rows_stride,
        pos_ptr,
        out_ptr,
        E,
        n,
        ratio,
        softmax_scale,
        head_scale,
        H: tl.constexpr,
        DI: tl.constexpr,
        BLOCK_E: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        e0 = tl.program_id(1) * BLOCK_E
        es = e0 + tl.arange(0, BLOCK_E)
        hs = tl.arange(0, H)
        ds = tl.arange(0, DI)
        visible = es < (tl.load(pos_ptr + t) + 1) // ratio
        live = visible & (es < E)
        q = tl.load(q_ptr + (t * H + hs)[:, None] * DI + ds[None, :]).to(tl.float32)  # [H, DI]
        rows = tl.load(rows_ptr + (t // n) * rows_stride + es, mask=live, other=0).to(tl.int64)
        k = tl.load(ent_ptr + rows[None, :] * ent_stride + ds[:, None], mask=live[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")  # [H, BLOCK_E]
        else:
            s = tl.dot(q, k.to(tl.float32))
        w = tl.load(w_ptr + t * w_stride + hs).to(tl.float32) * head_scale
        s = tl.maximum(s, 0.0) * softmax_scale * w[:, None]
        score = tl.sum(s, axis=0)
        score = tl.where(visible, score, float("-inf"))
        tl.store(out_ptr + t * E + es, score, mask=es < E)

    def _score_key(s):
        # int32 keys ordered as torch.sort orders float scores: -0.0 folded onto +0.0 (equal there), the bits of
        # negative scores flipped so keys grow with the value, every NaN (either sign) above +inf
        s = s + 0.0
        b = s.to(tl.int32, bitcast=True)
        return tl.where(s != s, 0x7FFFFFFF, tl.where(b < 0, b ^ 0x7FFFFFFF, b))

    def _csa_select_kernel(
        scores_ptr,
        rows_ptr,
        rows_stride,
        out_ptr,
        E,
        n,
        k,
        NEG_INF_KEY: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_J: tl.constexpr,
    ):
        # each program ranks BLOCK_I entries against all E (keys are unique, so ranks are a permutation) and
        # writes the ones ranked below k to their slot: parallel over entries, no sort
        t = tl.program_id(0).to(tl.int64)
        ii = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        im = ii < E
        # keys: (score desc, index asc) as one int64 sorting descending, the score's key over the complemented index
        ki = _score_key(tl.load(scores_ptr + t * E + ii, mask=im, other=float("-inf")))
        ki = ki.to(tl.int64) * 4294967296 + (2147483647 - ii).to(tl.int64)
        rank = tl.zeros([BLOCK_I], dtype=tl.int32)
        for j0 in range(0, E, BLOCK_J):
            jj = j0 + tl.arange(0, BLOCK_J)
            jm = jj < E
            kj = _score_key(tl.load(scores_ptr + t * E + jj, mask=jm, other=float("-inf")))
            kj = kj.to(tl.int64) * 4294967296 + (2147483647 - jj).to(tl.int64)
            rank += tl.sum(((kj[None, :] > ki[:, None]) & jm[None, :]).to(tl.int32), axis=1)
        live = ((ki >> 32) > NEG_INF_KEY) & im  # a score above -inf: a visible entry
        row = tl.load(rows_ptr + (t // n) * rows_stride + ii, mask=live, other=-1)
        tl.store(out_ptr + t * k + rank, tl.where(live, row, -1).to(out_ptr.dtype.element_ty), mask=im & (rank < k))


# ---- indexer_scores ----------------------------------------------------------------------------------------------


def indexer_scores_reference(
    q, weight_logits, entries, rows, pos, n: int, ratio: int, softmax_scale: float, head_scale: float
) -> torch.Tensor:
    """The engine's `Indexer.scores` math (keys gathered by pool row, float32) with invisible entries at -inf."""
    T, H, _ = q.shape
    B, E = rows.shape
    keys = entries[rows].float()  # [B, E, d]
    qg = q.float().view(B, n, H, -1)
    s = torch.matmul(qg, keys.transpose(1, 2).unsqueeze(1))  # [B, n, H, E]
    s = torch.relu(s) * softmax_scale
    w = (weight_logits.float() * head_scale).view(B, n, H)
    scores = (s * w.unsqueeze(-1)).sum(dim=2).view(T, E)
    visible = torch.arange(E, device=q.device)[None] < ((pos + 1) // ratio)[:, None]
    return scores.masked_fill(~visible, float("-inf"))


def indexer_scores(
    q,
    weight_logits,
    entries,
    rows,
    pos,
    n: int,
    ratio: int,
    softmax_scale: float,
    head_scale: float,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """[T, E] float32 scores of entries 0..E-1 for each query row (see module docstring). q [T, H, d] contiguous;
    weight_logits [T, H] (unit last stride); entries [N, d] pool; rows [T // n, E] pool rows of each request's
    entries; pos [T] positions; n rows per request."""
    T, H, DI = q.shape
    E = rows.shape[1]
    pow2 = H >= 16 and DI >= 16 and (H & (H - 1)) == 0 and (DI & (DI - 1)) == 0
    if not use_triton(backend, [q, weight_logits, entries, rows, pos]) or not pow2 or E == 0:
        return indexer_scores_reference(q, weight_logits, entries, rows, pos, n, ratio, softmax_scale, head_scale)
    q = q.contiguous()
    out = torch.empty(T, E, device=q.device, dtype=torch.float32)
    block_e = 64 if H * DI <= 4096 else 32
    jit(_indexer_scores_kernel, ("E", "n"))[(T, triton.cdiv(E, block_e))](
        q,
        weight_logits,
        weight_logits.stride(0),
        entries,
        entries.stride(0),
        rows,
        rows.stride(0),
        pos,
        out,
        E,
        n,
        ratio,
        float(softmax_scale),
        float(head_scale),
        H=H,
        DI=DI,
        BLOCK_E=block_e,
        IEEE=q.dtype == torch.float32,
        num_warps=4,
    )
    return out


# ---- csa_select --------------------------------------------------------------------------------------------------

# the packed-key high word of -inf: float bits 0xFF800000 as int32, negative floats flipped to sort ascending
_NEG_INF_KEY = (0xFF800000 - (1 << 32)) ^ 0x7FFFFFFF


def csa_select_reference(scores: torch.Tensor, rows: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Stable descending sort (ties: lower entry index first), first k, -inf (invisible) picks -> -1, else the
    request's pool row of the picked entry."""
    T, E = scores.shape
    B = rows.shape[0]
    top = torch.sort(scores, dim=-1, descending=True, stable=True)
    order, vals = top.indices[:, :k], top.values[:, :k]
    picked = rows.view(B, 1, E).expand(B, n, E).gather(2, order.view(B, n, k)).view(T, k)
    return torch.where(vals == float("-inf"), torch.full_like(picked, -1), picked)


def csa_select(scores: torch.Tensor, rows: torch.Tensor, n: int, k: int, *, backend: str = "auto") -> torch.Tensor:
    """[T, k] pool rows of each query row's k best entries by (score desc, index asc), -1 where the pick is an
    invisible (-inf) entry. scores [T, E] float32 contiguous (indexer_scores' output), rows [T // n, E]."""
    T, E = scores.shape
    if not use_triton(backend, [scores, rows]) or E >= 1 << 31 or k > E:
        return csa_select_reference(scores, rows, n, k)
    out = torch.empty(T, k, device=scores.device, dtype=rows.dtype)
    if T and k:
        block_i = 64
        jit(_csa_select_kernel, ("E", "n"), helpers=(_score_key,))[(T, triton.cdiv(E, block_i))](
            scores.contiguous(),
            rows,
            rows.stride(0),
            out,
            E,
            n,
            k,
            NEG_INF_KEY=_NEG_INF_KEY,
            BLOCK_I=block_i,
            BLOCK_J=128,
            num_warps=4,
        )
    return out
