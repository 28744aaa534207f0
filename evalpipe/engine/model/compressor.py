"""KV compressors (CSA overlapping, HCA non-overlapping, any ratio) and the lightning indexer.

A compressor projects every new row to `[kv | gate]`; each window of `ratio` positions that this forward completes
becomes one entry: softmax over the window slots of (gate + position_bias), weighted sum of kv, RMSNorm, RoPE
(compress rope) at the window's start position. With overlap (CSA) the projections are two series Ca | Cb and
entry w pools Ca of window w-1 with Cb of window w (2*ratio slots; window 0's Ca half is empty: kv 0, gate -inf).
Op order follows transformers' DeepseekV4{HCA,CSA}Compressor so a fused ratio-2 kernel can replace `pool` 1:1."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.engine.cache import CompressorPool, StatePools
from evalpipe.engine.forward_batch import ForwardBatch, entry_index, window_plan
from evalpipe.engine.model.config import RopeTable
from evalpipe.engine.model.primitives import apply_rope, rms_norm


class Compressor:
    def __init__(self, sd: dict, prefix: str, *, ratio: int, dim: int, overlap: bool, eps: float, rope: RopeTable):
        self.ratio, self.dim, self.overlap, self.eps, self.rope = ratio, dim, overlap, eps, rope
        # kv and gate projections stacked: one GEMM per forward
        self.w_kv_gate = torch.cat([sd[prefix + "kv_proj.weight"], sd[prefix + "gate_proj.weight"]], dim=0)
        self.position_bias = sd[prefix + "position_bias"].float()
        self.norm_w = sd[prefix + "kv_norm.weight"].float()
        self.proj_dim = dim * (2 if overlap else 1)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2 * proj_dim] = [kv | gate] of every new row (stored in the ring, no bias)."""
        return F.linear(x, self.w_kv_gate)

    def pool(self, proj: torch.Tensor, batch: ForwardBatch, pool: CompressorPool) -> None:
        """Write the entries of every window completed by this forward into the paged entry pool."""
        for group in batch.groups:
            plan = window_plan(group, batch.pools, self.ratio, pool.lookback, pool.ring_size, self.overlap)
            if plan is None:  # no request of the group completes a window in this forward
                continue
            rows = torch.cat([pool.ring[plan.past_cells], proj[group.rows]], dim=1)  # [G, lookback + n, 2P]
            g = torch.arange(group.size, device=rows.device)[:, None, None]
            cur = rows[g, plan.cur]  # [G, nw, ratio, 2P]
            kv, gate = cur[..., : self.proj_dim], cur[..., self.proj_dim :] + self.position_bias
            if self.overlap:
                d = self.dim
                prev = rows[g, plan.prev]
                prev_kv = prev[..., :d]
                prev_gate = prev[..., self.proj_dim : self.proj_dim + d] + self.position_bias[:, :d]
                keep = plan.has_prev[..., None, None]
                prev_kv = torch.where(keep, prev_kv, torch.zeros_like(prev_kv))
                prev_gate = torch.where(keep, prev_gate, torch.full_like(prev_gate, float("-inf")))
                kv = torch.cat([prev_kv, kv[..., d:]], dim=2)
                gate = torch.cat([prev_gate, gate[..., d:]], dim=2)
            pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
            entries = rms_norm(pooled, self.norm_w, self.eps)
            entries = apply_rope(entries, self.rope.cos[plan.entry_pos], self.rope.sin[plan.entry_pos], self.rope.rot)
            pool.entries.index_copy_(0, plan.out_rows.flatten(), entries.flatten(0, 1).to(pool.entries.dtype))


class Indexer:
    """Lightning indexer: its own overlapping compressor at index_head_dim, and per query the top-k entries by
    sum_h w[t,h] * ReLU(q[t,h] . k[s]) among causally visible entries; picks past the visible ones are -1.

    Tie rule (deterministic and causal): entries are ranked by (score descending, entry index ascending) -- a
    stable sort of the scores -- so equal scores at the top-k boundary always keep the earliest entries,
    whatever the sequence length or batch composition. (torch.topk's tie order depends on the row length, which
    makes even transformers' full-sequence forward non-causal at exact ties.)"""

    def __init__(self, sd: dict, prefix: str, config, rope: RopeTable):
        self.ratio = config.compress_rates["compressed_sparse_attention"]
        self.heads, self.dim, self.topk = config.index_n_heads, config.index_head_dim, config.index_topk
        self.compressor = Compressor(
            sd, prefix, ratio=self.ratio, dim=self.dim, overlap=True, eps=config.rms_norm_eps, rope=rope
        )
        self.q_b = sd[prefix + "q_b_proj.weight"]
        self.weights_proj = sd[prefix + "scorer.weights_proj.weight"]
        self.rope = rope

    def queries(self, x: torch.Tensor, q_residual: torch.Tensor, pos: torch.Tensor):
        q = F.linear(q_residual, self.q_b).view(x.shape[0], self.heads, self.dim)
        q = apply_rope(q, self.rope.cos[pos], self.rope.sin[pos], self.rope.rot)
        weights = F.linear(x, self.weights_proj).float() * self.heads**-0.5
        return q, weights

    def queries_from(self, q_proj: torch.Tensor, weight_logits: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`queries` from already projected rows (q_residual @ q_b, x @ weights_proj) and the rows' cos/sin."""
        q = apply_rope(q_proj.view(q_proj.shape[0], self.heads, self.dim), cos, sin, self.rope.rot)
        return q, weight_logits.float() * self.heads**-0.5

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, group, pools: StatePools, pool: CompressorPool
    ) -> torch.Tensor:
        """[G, n, k] selected entry indices per query (-1 = none), k = min(index_topk, entries in the group)."""
        scores, visible, k = self.scores(q, weights, group, pools, pool)
        if k == 0:
            return torch.empty(group.size, group.n, 0, dtype=torch.long, device=scores.device)
        return causal_topk(scores, visible, k)

    def scores(
        self, q: torch.Tensor, weights: torch.Tensor, group, pools: StatePools, pool: CompressorPool
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """([G, n, E] float32 scores of every entry, [G, n, E] causal visibility, k): what `select` ranks (also
        the input of the fused CSA sites in engine/model/fused_sites.py)."""
        rows, visible = entry_index(group, pools, self.ratio)
        k = min(self.topk, rows.shape[1])
        keys = pool.entries[rows].float()  # [G, E, d]
        scores = torch.matmul(q[group.rows].float(), keys.transpose(1, 2).unsqueeze(1))  # [G, n, H, E]
        scores = F.relu(scores) * self.dim**-0.5
        scores = (scores * weights[group.rows].unsqueeze(-1)).sum(dim=2)  # [G, n, E]
        return scores, visible, k


def causal_topk(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [..., k] of the k best visible columns, ranked by (score desc, index asc); -1 where fewer than k
    columns are visible. The rank of a visible column never depends on invisible ones, so a query's selection is
    the same whatever the sequence length (causal) and whatever the batch padding."""
    count = scores.shape[-1]
    if k >= count:
        order = torch.arange(count, device=scores.device).expand(*scores.shape[:-1], count)
    else:
        masked = scores.masked_fill(~visible, float("-inf"))
        order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.where(torch.gather(visible, -1, order), order, torch.full_like(order, -1))


def index_order(picked: torch.Tensor) -> torch.Tensor:
    """`picked` [..., k] (entry indices, -1 = none) sorted by entry index, the -1s last: the picked set in one order.
    causal_topk's order is score-descending when the row has more than k entries and index order when it has at
    most k, and the row's entry count E follows its group (the chunk, the longest request beside it), so a query
    whose visible entries are all picked would meet them in an order that depends on its batch; the attention
    kernel sums its entry slots in slot order (--deterministic sorts, engine/model/fused_sites.py)."""
    if picked.numel() == 0:
        return picked
    none = torch.iinfo(picked.dtype).max
    ordered = torch.where(picked < 0, torch.full_like(picked, none), picked).sort(dim=-1).values
    return torch.where(ordered == none, torch.full_like(ordered, -1), ordered)
