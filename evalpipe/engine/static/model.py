"""StaticModel: the engine model's forward over a fixed-shape StaticBatch, with every op capture-safe.

The same weights and layer objects as the eager model (engine/model), but no data-dependent shape and no host read,
and every op chain one or two launches so a batch-1 step is not bound by kernel launches (evalpipe.kernels: mHC
between blocks in 2 per block, the attention core, q/kv norms, indexer scores and the CSA top-k, the MoE block, the
compressor windows). Each op falls back to its PyTorch reference off CUDA, so the same forward runs eagerly on the
CPU (the "dry path" the CPU tests check against the plain runner); engine/static/graphs.py captures it on CUDA.

`fused=True` routes the fusion sites of the step through `evalpipe.kernels`: `q_rope_store` for the RoPE of q, of
the shared K=V head and of the indexer queries and for the inverse RoPE of the attention output;
`ratio2_compress_verify` for the ratio-2 compressors. `fused=False` runs the engine's reference chains (`apply_rope`,
`Compressor.pool`) at exactly those sites and changes nothing else, so fusion can be A/B'd in one build. The model's own
fused sites (CSA selection, `--wo-quant`) are its construction-time setting (engine/model/fused_sites.py) and run here
too."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from evalpipe.engine.forward_batch import entry_index
from evalpipe.engine.model import fused_sites
from evalpipe.engine.model.attention import visible_hca_rows
from evalpipe.engine.model.config import RopeTable
from evalpipe.engine.model.primitives import apply_rope
from evalpipe.engine.static.batch import StaticBatch
from evalpipe.kernels import indexer, norm, q_rope_store, ratio2_compress_verify
from evalpipe.kernels.attention import fused_attention
from evalpipe.kernels.batch_invariant import invariant_ops
from evalpipe.kernels.compress import compress
from evalpipe.kernels.moe import moe_forward


class _Rope:
    """Half-width (one value per pair) cos/sin tables for `evalpipe.kernels`, from an engine RopeTable."""

    def __init__(self, table):
        self.cos = table.cos[:, 0::2].contiguous()
        self.sin = table.sin[:, 0::2].contiguous()
        self.neg_sin = (-self.sin).contiguous()


class StaticModel:
    """The engine model's forward over a StaticBatch: same weights and layer objects, capture-safe ops."""

    def __init__(self, model, *, fused: bool, kernel_backend: str = "auto"):
        self.model, self.fused, self.backend = model, fused, kernel_backend
        self._ropes: dict[int, _Rope] = {}

    def _rope(self, table) -> _Rope:
        key = id(table)
        if key not in self._ropes:
            self._ropes[key] = _Rope(table)
        return self._ropes[key]

    def forward(self, batch: StaticBatch, pools) -> torch.Tensor:
        """Embedding -> [mHC, attention, mHC, MoE] x L -> hyper head -> norm -> lm_head. Each block boundary is two
        kernels (`kernels.hyper`: the merge that ends a block also computes the next hyper-connection's mixing
        partials; the next block starts by reducing them, Sinkhorn, collapse and its input RMSNorm)."""
        m = self.model
        # --deterministic: batch-invariant GEMMs inside the captured step, as 64-row library products (a step has
        # at most a few slabs of rows; kernels/batch_invariant.py)
        with invariant_ops(m.deterministic, gemm="slabs"):
            h = m.hidden_through_kernels(
                F.embedding(batch.input_ids, m.embed),
                lambda i, layer, x: self.attention(layer.attn, x, batch, pools.layers[i]),
                lambda layer, x: self.moe(layer.mlp, x, batch.input_ids),
                self.backend,
            )
            return F.linear(h, m.lm_head).float()

    def _rotate(self, x: torch.Tensor, table: RopeTable, batch: StaticBatch, inverse: bool = False) -> torch.Tensor:
        """Interleaved RoPE of every row: fused, one `q_rope_store` kernel (bitwise equal to the engine's
        apply_rope); unfused, the engine's own `apply_rope` chain."""
        if not self.fused:
            cos, sin, neg_sin = batch.rope(table)
            return apply_rope(x, cos, neg_sin if inverse else sin, table.rot)
        r = self._rope(table)
        x3 = x if x.dim() == 3 else x.unsqueeze(1)
        out = q_rope_store(
            x3, torch.empty_like(x3), r.cos, r.neg_sin if inverse else r.sin, batch.pos, backend=self.backend
        )
        return out if x.dim() == 3 else out.squeeze(1)

    def attention(self, attn, x: torch.Tensor, batch: StaticBatch, pool) -> torch.Tensor:
        """`engine.attention.Attention.__call__` for one fixed-shape group in few launches: one GEMM for every
        projection of x and one for both projections of q_residual (as the eager layer), q/kv norms in one kernel,
        the indexer's scores in one kernel, the attention core (window ring + this forward's rows + compressed
        entries + sink) in one kernel. The fusion sites -- RoPE of q and of the K=V head, the inverse RoPE of the
        output, the ratio-2 compressor -- go through `evalpipe.kernels` (fused) or the engine's reference chains."""
        T = x.shape[0]
        H, D = attn.heads, attn.head_dim
        group = batch.groups[0]
        projected = F.linear(x, attn.w_in).split(attn.in_splits, dim=-1)
        q_residual = norm.rms_norm(projected[0], attn.q_a_norm, attn.eps, backend=self.backend)
        qb = F.linear(q_residual, attn.w_qb)
        qkv = norm.qkv_norm(qb[:, : H * D], projected[1], attn.kv_norm, H, attn.eps, backend=self.backend)
        qkv = self._rotate(qkv, attn.rope, batch)
        q, kv = qkv[:, :H], qkv[:, H]

        entries = entry_rows = None
        if attn.compressor is not None:
            self.compress(attn.compressor, projected[2], batch, pool.compressor)
            entries = pool.compressor.entries
            rows = entry_index(group, batch.pools, attn.ratio)[0]  # [B, E] pool rows of entries 0..E-1
            if attn.indexer is None:  # HCA: every causally visible entry (per step and ratio, shared by layers)
                entry_rows = visible_hca_rows(group, rows, batch.pos, attn.ratio)
            else:  # CSA: the indexer's top-k
                idx = attn.indexer
                self.compress(idx.compressor, projected[3], batch, pool.indexer)
                iq = self._rotate(qb[:, H * D :].view(T, idx.heads, idx.dim), idx.rope, batch)
                scores = indexer.indexer_scores(
                    iq,
                    projected[4],
                    pool.indexer.entries,
                    rows,
                    batch.pos,
                    group.n,
                    attn.ratio,
                    idx.dim**-0.5,
                    idx.heads**-0.5,
                    backend=self.backend,
                )
                entry_rows = self.csa_rows(attn, scores, rows, batch)

        out = fused_attention(
            q,
            kv,
            pool.window,
            batch.pools.window_ring,
            attn.window,
            batch.pos,
            batch.slot,
            group.n,
            entries,
            entry_rows,
            attn.sinks,
            attn.head_dim**-0.5,
            backend=self.backend,
            invariant=self.model.deterministic,
        )
        # rings last: the reads above must see the pre-forward history
        attn._store_ring(pool.window, kv, batch, batch.pools.window_ring)
        if attn.compressor is not None:
            attn._store_ring(pool.compressor.ring, projected[2], batch, pool.compressor.ring_size)
        if attn.indexer is not None:
            attn._store_ring(pool.indexer.ring, projected[3], batch, pool.indexer.ring_size)

        out = self._rotate(out, attn.rope, batch, inverse=True)
        if attn.wo_b_mxfp8 is not None:  # --wo-quant mxfp8 (engine/model/fused_sites.py)
            return fused_sites.wo_project(attn, out)
        grouped = out.view(T, attn.groups, -1).transpose(0, 1)
        grouped = torch.bmm(grouped, attn.o_a_t).transpose(0, 1).reshape(T, -1)
        return F.linear(grouped, attn.o_b)

    def csa_rows(self, attn, scores: torch.Tensor, rows: torch.Tensor, batch: StaticBatch) -> torch.Tensor:
        """[T, k] pool rows of each query's top-k entries (-1 = none) from the indexer's masked scores [T, E]:
        through the fused CSA sites (candidate_block_mask, indexer_postprocess) when the model is built with
        sites (the server), else `kernels.indexer.csa_select` (rank by score desc, entry index asc, as
        `causal_topk`)."""
        group = batch.groups[0]
        E = scores.shape[1]
        k = min(attn.indexer.topk, E)
        if attn.site_settings is not None:
            return fused_sites.csa_rows(attn, scores, group, batch, k)
        return indexer.csa_select(scores, rows, group.n, k, backend=self.backend)

    def compress(self, comp, proj: torch.Tensor, batch: StaticBatch, cpool) -> None:
        if not (comp.ratio == 2 and not comp.overlap):  # not a fusion site: the graph path's one-kernel pooling
            compress(comp, proj, batch, cpool, backend=self.backend)
            return
        if not self.fused:  # the C2 fusion site, reference chain
            comp.pool(proj, batch, cpool)
            return
        r = self._rope(comp.rope)
        pools = batch.pools
        ratio2_compress_verify(
            proj,
            batch.pos,
            batch.slot,
            batch.row_valid,
            comp.position_bias,
            comp.norm_w,
            comp.eps,
            r.cos,
            r.sin,
            comp.rope.rope_dim,
            cpool.ring,
            cpool.entries,
            pools.page_table_on_device(),
            pools.page_tokens // 2,
            cpool.ring_size,
            batch.groups[0].n,
            backend=self.backend,
        )

    def moe(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Routed experts read by device-side index (no sort, no host counts) plus the shared expert as one more
        pick: router GEMM, route, gate_up + SwiGLU, down + weighted sum (`kernels.moe`, 4 launches)."""
        return moe_forward(moe, x, input_ids, backend=self.backend, invariant=self.model.deterministic)
