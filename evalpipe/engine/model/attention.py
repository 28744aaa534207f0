"""DeepSeek-V4 attention for serving: low-rank q with norms, one shared K=V head with a per-head sink, interleaved
partial RoPE, sliding window over a per-request ring, compressed entries (all visible ones for HCA, indexer top-k
for CSA), inverse RoPE on the output and the grouped output projection (o_a_proj per group, then o_b_proj)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.engine.cache import LayerPool
from evalpipe.engine.forward_batch import ForwardBatch, entry_index, entry_mask, window_keys_index
from evalpipe.engine.model import fused_sites
from evalpipe.engine.model.compressor import Compressor, Indexer
from evalpipe.engine.model.config import CSA, SLIDING, RopeTable, compress_ratio
from evalpipe.engine.model.primitives import apply_rope, rms_norm, unweighted_rms_norm
from evalpipe.kernels.attention import fused_attention, fused_attention_applies, hca_entry_rows


def visible_hca_rows(group, pool_rows: torch.Tensor, pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pool rows of every causally visible entry of an HCA layer for the group's flattened rows at `pos`, computed
    once per group and ratio and shared by its HCA layers (the static step's batch fills the same memo key)."""
    key = ("hca_rows", ratio)
    if key not in group.memo:
        group.memo[key] = hca_entry_rows(pool_rows, pos, group.n, ratio)
    return group.memo[key]


class Attention:
    def __init__(
        self,
        sd: dict,
        prefix: str,
        config,
        layer_type: str,
        ropes: dict[str, RopeTable],
        sites: fused_sites.SiteSettings | None = None,
    ):
        self.layer_type = layer_type
        self.heads, self.head_dim, self.eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
        self.window = config.sliding_window
        self.groups, self.o_rank = config.o_groups, config.o_lora_rank
        self.rope = ropes["main" if layer_type == SLIDING else "compress"]
        self.q_a = sd[prefix + "q_a_proj.weight"]
        self.q_a_norm = sd[prefix + "q_a_norm.weight"].float()
        self.q_b = sd[prefix + "q_b_proj.weight"]
        self.kv_proj = sd[prefix + "kv_proj.weight"]
        self.kv_norm = sd[prefix + "kv_norm.weight"].float()
        group_in = self.heads * self.head_dim // self.groups
        self.o_a = sd[prefix + "o_a_proj.weight"].view(self.groups, self.o_rank, group_in)  # [g, rank, in]
        self.o_a_t = self.o_a.transpose(1, 2)
        self.o_b = sd[prefix + "o_b_proj.weight"]
        self.sinks = sd[prefix + "sinks"].float()
        self.ratio = compress_ratio(config, layer_type)
        self.compressor = self.indexer = None
        if layer_type != SLIDING:
            self.compressor = Compressor(
                sd,
                prefix + "compressor.",
                ratio=self.ratio,
                dim=self.head_dim,
                overlap=layer_type == CSA,
                eps=self.eps,
                rope=ropes["compress"],
            )
            if layer_type == CSA:
                self.indexer = Indexer(sd, prefix + "compressor.indexer.", config, ropes["compress"])
        # every projection of the block input x in one GEMM: q_a | kv | compressor kv,gate | indexer kv,gate,weights
        parts = [self.q_a, self.kv_proj]
        if self.compressor is not None:
            parts.append(self.compressor.w_kv_gate)
        if self.indexer is not None:
            parts += [self.indexer.compressor.w_kv_gate, self.indexer.weights_proj]
        self.w_in = torch.cat(parts, dim=0)
        self.in_splits = [p.shape[0] for p in parts]
        # and both projections of q_residual: attention q_b | indexer q_b
        self.w_qb = torch.cat([self.q_b, self.indexer.q_b], dim=0) if self.indexer is not None else self.q_b
        # the fused sites (engine/model/fused_sites.py): None keeps the plain CSA selection; the MXFP8-rounded o_b
        # of `--wo-quant mxfp8`
        self.site_settings = sites
        self.wo_b_mxfp8 = fused_sites.quantized_wo_b(self, sites)

    def __call__(self, x: torch.Tensor, batch: ForwardBatch, pool: LayerPool) -> torch.Tensor:
        T = x.shape[0]
        cos, sin, neg_sin = batch.rope(self.rope)
        projected = F.linear(x, self.w_in).split(self.in_splits, dim=-1)
        q_residual = rms_norm(projected[0], self.q_a_norm, self.eps)
        qb = F.linear(q_residual, self.w_qb)
        q = unweighted_rms_norm(qb[:, : self.heads * self.head_dim].view(T, self.heads, self.head_dim), self.eps)
        kv = rms_norm(projected[1], self.kv_norm, self.eps)
        # one RoPE call for the query heads and the shared K=V head
        qkv = apply_rope(torch.cat([q, kv.unsqueeze(1)], dim=1), cos, sin, self.rope.rot)
        q, kv = qkv[:, : self.heads], qkv[:, self.heads]

        comp_proj = idx_proj = idx_q = None
        if self.compressor is not None:
            comp_proj = projected[2]
            self.compressor.pool(comp_proj, batch, pool.compressor)
        if self.indexer is not None:
            idx_proj = projected[3]
            self.indexer.compressor.pool(idx_proj, batch, pool.indexer)
            idx_q = self.indexer.queries_from(qb[:, self.heads * self.head_dim :], projected[4], cos, sin)

        if len(batch.groups) == 1 and not batch.groups[0].padded:
            out = self._attend(q, kv, batch.groups[0], batch, pool, idx_q).view(T, self.heads, self.head_dim)
        else:
            out = torch.empty_like(q)
            for group in batch.groups:
                group.scatter(out, self._attend(q, kv, group, batch, pool, idx_q))

        # rings last: the reads above must see the pre-forward history
        self._store_ring(pool.window, kv, batch, batch.pools.window_ring)
        if comp_proj is not None:
            self._store_ring(pool.compressor.ring, comp_proj, batch, pool.compressor.ring_size)
        if idx_proj is not None:
            self._store_ring(pool.indexer.ring, idx_proj, batch, pool.indexer.ring_size)
        if pool.window_tail is not None:  # prefix cache: each page keeps its end-of-page ring rows (cache.py)
            self._store_tail(pool.window_tail, kv, batch, batch.pools.window_tail_rows)
            for comp, proj in ((pool.compressor, comp_proj), (pool.indexer, idx_proj)):
                if comp is not None:
                    self._store_tail(comp.tail, proj, batch, comp.tail_rows)

        out = apply_rope(out, cos, neg_sin, self.rope.rot)
        if self.wo_b_mxfp8 is not None:  # --wo-quant mxfp8: wo_a_mxfp8 + mxfp8_linear (fused_sites)
            return fused_sites.wo_project(self, out)
        grouped = out.view(T, self.groups, -1).transpose(0, 1)  # [g, T, group_in]
        grouped = torch.bmm(grouped, self.o_a_t).transpose(0, 1).reshape(T, -1)
        return F.linear(grouped, self.o_b)

    @staticmethod
    def _store_ring(ring: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, ring_size: int) -> None:
        rows, cells = batch.ring_writes(ring_size)
        ring.index_copy_(0, cells, values[rows].to(ring.dtype))

    @staticmethod
    def _store_tail(tail: torch.Tensor, values: torch.Tensor, batch: ForwardBatch, tail_rows: int) -> None:
        rows, cells = batch.tail_writes(tail_rows)
        if rows.numel():
            tail.index_copy_(0, cells, values[rows].to(tail.dtype))

    def _attend(self, q, kv, group, batch: ForwardBatch, pool: LayerPool, idx_q) -> torch.Tensor:
        """[G, n, H, D] attention output of one group: window keys from the ring + this forward's rows, then
        compressed entries; one softmax over both with the per-head sink as an extra (dropped) column.

        Built with sites (the server) and where the attention kernel applies (CUDA; `--fused` does not reach the
        eager path), a prompt chunk goes through the same kernel as the CUDA-graph step: each query row gathers its
        keys by address, so neither the [G, n, k, D] entry gather nor the unfolded window is materialised (on the
        H200 the eager chain's strided attention GEMMs and gathers were ~40 of the 93 ms of a 3500-row chunk)."""
        settings = self.site_settings
        if settings is not None and fused_attention_applies(
            settings.backend, q, kv, pool.window, self._entries(pool), self.sinks
        ):
            return self._attend_kernel(q, kv, group, batch, pool, idx_q, settings.backend)
        scale = self.head_dim**-0.5
        qg = q[group.rows]  # [G, n, H, D]
        cells, key_ok = window_keys_index(group, batch.pools.window_ring, self.window)
        keys = torch.cat([pool.window[cells], kv[group.rows]], dim=1)  # [G, W-1+n, D]
        win = keys.unfold(1, self.window, 1)  # [G, n, D, W]: window of query i = positions t-W+1 .. t
        logits = [(torch.matmul(qg, win) * scale).masked_fill_(key_ok, float("-inf"))]

        comp = None
        if self.compressor is not None:
            if self.indexer is not None:
                if self.site_settings is not None:  # built with sites (serve): the fused-site chain
                    # indexer scores -> candidate_block_mask -> top-k -> indexer_postprocess (page table) -> rows
                    comp, empty = fused_sites.csa_entries(self, idx_q, group, batch, pool)  # [G,n,k,D], [G,n,k]
                else:  # plain runner: the same selection without the kernels' references (fewer CPU ops)
                    picked = self.indexer.select(*idx_q, group, batch.pools, pool.indexer)  # [G, n, k]
                    rows = entry_index(group, batch.pools, self.ratio)[0]
                    g = torch.arange(group.size, device=picked.device)[:, None, None]
                    comp = pool.compressor.entries[rows[g, picked.clamp(min=0)]]  # [G, n, k, D]
                    empty = picked < 0
                cl = torch.matmul(qg, comp.transpose(-1, -2)) * scale
                cl = cl.masked_fill_(empty.unsqueeze(2), float("-inf"))
            else:
                rows = entry_index(group, batch.pools, self.ratio)[0]
                comp = pool.compressor.entries[rows].unsqueeze(1)  # [G, 1, E, D]
                cl = torch.matmul(qg, comp.transpose(-1, -2)) * scale
                cl = cl.masked_fill_(entry_mask(group, batch.pools, self.ratio), float("-inf"))
            logits.append(cl)
        logits.append(self.sinks.expand(group.size, group.n, self.heads).unsqueeze(-1))
        combined = torch.cat(logits, dim=-1)
        probs = (combined - combined.amax(dim=-1, keepdim=True)).softmax(dim=-1)  # float32 when q is bf16 (sinks)
        if probs.dtype != win.dtype:
            probs = probs.to(win.dtype)
        out = torch.matmul(probs[..., : self.window], win.transpose(-1, -2))
        if comp is not None:
            out = out + torch.matmul(probs[..., self.window : -1], comp)
        return out

    def _entries(self, pool: LayerPool) -> torch.Tensor | None:
        return pool.compressor.entries if self.compressor is not None else None

    def _attend_kernel(self, q, kv, group, batch: ForwardBatch, pool: LayerPool, idx_q, backend: str) -> torch.Tensor:
        """`_attend` through `kernels.attention.fused_attention` on the group's flattened rows: entry rows of every
        visible entry (HCA) or of the indexer's top-k through the fused CSA sites (CSA), as the static step."""
        G, n = group.size, group.n
        rows = group.rows.reshape(-1)
        pos = group.pos.reshape(-1)
        entries, entry_rows = self._entries(pool), None
        if entries is not None:
            pool_rows = entry_index(group, batch.pools, self.ratio)[0]  # [G, E]
            if self.indexer is None:
                entry_rows = visible_hca_rows(group, pool_rows, pos, self.ratio)
            else:
                scores, visible, k = self.indexer.scores(*idx_q, group, batch.pools, pool.indexer)  # [G, n, E]
                E = scores.shape[-1]
                entry_rows = (
                    fused_sites.csa_rows(
                        self, scores.masked_fill(~visible, float("-inf")).reshape(G * n, E), group, batch, k
                    )
                    if k
                    else pool_rows.new_empty(G * n, 0)
                )
        fused_sites.count("eager_attention_kernel")
        out = fused_attention(
            q[rows],
            kv[rows],
            pool.window,
            batch.pools.window_ring,
            self.window,
            pos,
            group.slots.repeat_interleave(n),
            n,
            entries,
            entry_rows,
            self.sinks,
            self.head_dim**-0.5,
            backend=backend,
            invariant=self.site_settings.deterministic,
        )
        return out.view(G, n, self.heads, self.head_dim)
