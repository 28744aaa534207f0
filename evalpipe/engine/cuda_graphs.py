"""CUDA-graph capture of the fixed-shape decode and verify steps, per batch-size bucket.

`GraphRunner` wraps a `ModelRunner` and has its interface (`forward`, `truncate`, `allocate`, ...). A forward in
which every sequence feeds the same number of rows n, with n one of `widths` (1 = decode, G+1 = verify), and at
most the largest bucket of sequences, runs the *static step* of bucket B (the smallest bucket that fits); any
other forward (prefill chunks, mixed widths) goes to the wrapped runner unchanged.

The static step is the engine's model with every data-dependent shape and host read removed:
- inputs live in one persistent device buffer (token ids, starts, slots, row-valid flags and the page table), filled
  by a single host-to-device copy before the step; everything else is derived on the device inside the step (every
  index array in one kernel, `step_meta`);
- batches are padded with *whole* requests: a padding request uses the reserved `pad_slot` (its own ring regions,
  no pages, so its page-table row is the trash page), position 0.., and row_valid 0. Every write is addressed by the
  row's own metadata (ring cell slot*R + pos % R, entry rows through the slot's page-table row, or gated by
  row_valid in the fused C2 kernel), so a padding row never touches a live request's state;
- compressed entries are attended over the fixed maximum count (max_seq_len // ratio) with the
  causal visibility mask, instead of the live count (which needs a host read);
- every op chain is one or two launches, so a batch-1 step is not bound by kernel launches: mHC between blocks
  (`step_hyper`, 2 per block), the attention core (`step_attention`), q/kv norms, indexer scores and the CSA top-k
  (`step_attn_inputs`), the MoE block (`step_moe`: the eager MoE reads expert counts to the host), RMSNorm and the
  (non-C2) compressor windows (`graph_ops`: the eager compressor skips idle windows by reading starts on the host).
  Each has a PyTorch reference, which is what runs on the CPU.

On CUDA each (bucket, width) step is captured once into a `torch.cuda.CUDAGraph` (after two warm-up runs that
compile the Triton kernels) and replayed; the step contains no host synchronisation. On the CPU the same static
step runs eagerly (the "dry path"), which is what the CPU tests check against the plain runner.

`fused=True` routes the fusion sites of the step through `evalpipe.kernels`: `q_rope_store` for the RoPE of q, of
the shared K=V head and of the indexer queries and for the inverse RoPE of the attention output; `c2_verify` for the
ratio-2 compressors.
`fused=False` runs the engine's reference chains (`apply_rope`, `Compressor.pool`) at exactly those sites and
changes nothing else in the captured step, so fusion can be A/B'd in one build.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from evalpipe.engine.forward_batch import Group, RowRope, entry_index
from evalpipe.engine.primitives import apply_rope
from evalpipe.kernels import attention as step_attention, hyper as step_hyper, indexer, norm
from evalpipe.kernels.compress import compress
from evalpipe.kernels.moe import moe_forward
from evalpipe.kernels.step_meta import MetaShape, step_meta

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(batch: int, buckets) -> int:
    """Smallest bucket that holds `batch` requests (ValueError past the largest)."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    raise ValueError(f"batch {batch} exceeds the largest graph bucket {max(buckets)}")


def pack_step_inputs(tokens: list[list[int]], starts: list[int], slots: list[int], bucket: int, pad_slot: int,
                     page_table: torch.Tensor) -> torch.Tensor:
    """The step's one input buffer (int64, on the host): ids [B*n] | starts [B] | slots [B] | row_valid [B*n] |
    page table. Requests past len(tokens) are padding: token 0, start 0, `pad_slot`, row_valid 0."""
    n = len(tokens[0])
    if any(len(t) != n for t in tokens):
        raise ValueError("every request of a static step feeds the same number of rows")
    pad = bucket - len(tokens)
    if pad < 0:
        raise ValueError(f"{len(tokens)} requests do not fit bucket {bucket}")
    ids = [t for toks in tokens for t in toks] + [0] * (pad * n)
    head = torch.tensor(ids + list(starts) + [0] * pad + list(slots) + [pad_slot] * pad
                        + [1] * (len(tokens) * n) + [0] * (pad * n), dtype=torch.long)
    return torch.cat([head, page_table.reshape(-1).to(torch.long)])


class StaticBatch(RowRope):
    """The `ForwardBatch` interface over device buffers of fixed shape: B requests of n rows, one group."""

    def __init__(self, pools, meta: torch.Tensor, B: int, n: int, consts: dict, backend: str = "auto"):
        T = B * n
        self.pools, self.num_rows = pools, T
        self.input_ids = meta[:T]
        starts, slots = meta[T:T + B], meta[T + B:T + 2 * B]
        self.row_valid = meta[T + 2 * B:2 * T + 2 * B] != 0
        # positions, slots, ring cells, entry rows: one kernel (step_meta) from the input buffer
        info = step_meta(meta, consts["meta_shape"], backend=backend)
        self.pos, self.slot = info.pos, info.slot
        rows = consts["rows"]
        self.last_rows = rows[:, -1]
        # host_starts None: window plans take their fixed worst-case shape, `valid` masks the rest on device
        self.groups = [Group(n=n, slots=slots, starts=starts, rows=rows, pos=info.pos.view(B, n), host_starts=None)]
        self._ring_writes = {R: (slice(None), cells) for R, cells in info.cells.items()}  # every row is stored
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        group = self.groups[0]
        # entries: the fixed maximum count (as if every request ended at max_seq_len), so there is no host read of
        # the live maximum; the static path reads only the rows (visibility: -inf scores for CSA, HCA rows of -1)
        for ratio, entry_rows in info.rows.items():
            group.memo[("entries", ratio)] = (entry_rows, None)
        if info.hca_rows is not None:
            group.memo[("hca_rows", consts["meta_shape"].hca_ratio)] = info.hca_rows

    def ring_writes(self, ring_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.groups[0].n > ring_size:
            raise ValueError(f"static step of {self.groups[0].n} rows exceeds ring size {ring_size}")
        return self._ring_writes[ring_size]


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
        kernels (`step_hyper`: the merge that ends a block also computes the next hyper-connection's mixing
        partials; the next block starts by reducing them, Sinkhorn, collapse and its input RMSNorm)."""
        m, b = self.model, self.backend
        eps = m.config.rms_norm_eps
        x = F.embedding(batch.input_ids, m.embed)
        streams = x.unsqueeze(1).expand(-1, m.config.hc_mult, -1).contiguous()
        parts = step_hyper.hc_mix(streams, m.layers[0].attn_hc, backend=b)
        for i, (layer, pool) in enumerate(zip(m.layers, pools.layers)):
            post, comb, h = step_hyper.hc_pre_norm(streams, parts, layer.attn_hc, layer.attn_norm, eps, backend=b)
            a = self.attention(layer.attn, h, batch, pool)
            streams, parts = step_hyper.hc_merge_mix(streams, a, post, comb, layer.ffn_hc, backend=b)
            post, comb, h = step_hyper.hc_pre_norm(streams, parts, layer.ffn_hc, layer.mlp_norm, eps, backend=b)
            y = self.moe(layer.mlp, h, batch.input_ids)
            nxt = m.layers[i + 1].attn_hc if i + 1 < len(m.layers) else m.head
            streams, parts = step_hyper.hc_merge_mix(streams, y, post, comb, nxt, backend=b)
        h = step_hyper.hc_head_norm(streams, parts, m.head, m.norm, eps, backend=b)
        return F.linear(h, m.lm_head).float()

    def _rotate(self, x: torch.Tensor, table, batch: StaticBatch, inverse: bool = False) -> torch.Tensor:
        """Interleaved RoPE of every row: fused, one `q_rope_store` kernel (bitwise equal to the engine's
        apply_rope); unfused, the engine's own `apply_rope` chain."""
        if not self.fused:
            cos, sin, neg_sin = batch.rope(table)
            rot = getattr(table, "rot", None)
            args = (x, cos, neg_sin if inverse else sin) + ((rot,) if rot is not None else ())
            return apply_rope(*args)
        from evalpipe.kernels import q_rope_store

        r = self._rope(table)
        x3 = x if x.dim() == 3 else x.unsqueeze(1)
        out = q_rope_store(x3, torch.empty_like(x3), r.cos, r.neg_sin if inverse else r.sin, batch.pos,
                           backend=self.backend)
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
        qkv = norm.qkv_norm(qb[:, : H * D], projected[1], attn.kv_norm, H, attn.eps,
                                        backend=self.backend)
        qkv = self._rotate(qkv, attn.rope, batch)
        q, kv = qkv[:, :H], qkv[:, H]

        entries = entry_rows = None
        if attn.compressor is not None:
            self.compress(attn.compressor, projected[2], batch, pool.compressor)
            entries = pool.compressor.entries
            rows = entry_index(group, batch.pools, attn.ratio)[0]  # [B, E] pool rows of entries 0..E-1
            if attn.indexer is None:  # HCA: every causally visible entry (per step and ratio, shared by layers)
                key = ("hca_rows", attn.ratio)
                if key not in group.memo:
                    group.memo[key] = step_attention.hca_entry_rows(rows, batch.pos, group.n, attn.ratio)
                entry_rows = group.memo[key]
            else:  # CSA: the indexer's top-k
                idx = attn.indexer
                self.compress(idx.compressor, projected[3], batch, pool.indexer)
                iq = self._rotate(qb[:, H * D:].view(T, idx.heads, idx.dim), idx.rope, batch)
                scores = indexer.indexer_scores(iq, projected[4], pool.indexer.entries, rows, batch.pos,
                                                         group.n, attn.ratio, idx.dim ** -0.5, idx.heads ** -0.5,
                                                         backend=self.backend)
                entry_rows = self.csa_rows(attn, scores, rows, batch)

        out = step_attention.fused_attention(q, kv, pool.window, batch.pools.window_ring, attn.window, batch.pos,
                                             batch.slot, group.n, entries, entry_rows, attn.sinks,
                                             attn.head_dim ** -0.5, backend=self.backend)
        # rings last: the reads above must see the pre-forward history
        attn._store_ring(pool.window, kv, batch, batch.pools.window_ring)
        if attn.compressor is not None:
            attn._store_ring(pool.compressor.ring, projected[2], batch, pool.compressor.ring_size)
        if attn.indexer is not None:
            attn._store_ring(pool.indexer.ring, projected[3], batch, pool.indexer.ring_size)

        out = self._rotate(out, attn.rope, batch, inverse=True)
        if getattr(attn, "wo_b_mxfp8", None) is not None:  # --wo-quant mxfp8 (engine/fused_sites.py)
            from evalpipe.engine.fused_sites import wo_project

            return wo_project(attn, out)
        grouped = out.view(T, attn.groups, -1).transpose(0, 1)
        grouped = torch.bmm(grouped, attn.o_a_t).transpose(0, 1).reshape(T, -1)
        return F.linear(grouped, attn.o_b)

    def csa_rows(self, attn, scores: torch.Tensor, rows: torch.Tensor, batch: StaticBatch) -> torch.Tensor:
        """[T, k] pool rows of each query's top-k entries (-1 = none) from the indexer's masked scores [T, E]:
        through the fused CSA sites (candidate_block_mask, indexer_postprocess) when the model is configured for
        them (the server), else `step_attn_inputs.csa_select` (rank by score desc, entry index asc, as `causal_topk`)."""
        group = batch.groups[0]
        E = scores.shape[1]
        k = min(attn.indexer.topk, E)
        if getattr(attn, "site_settings", None) is not None:
            from evalpipe.engine.fused_sites import csa_rows

            return csa_rows(attn, scores, group, batch, k)
        return indexer.csa_select(scores, rows, group.n, k, backend=self.backend)

    def compress(self, comp, proj: torch.Tensor, batch: StaticBatch, cpool) -> None:
        if not (comp.ratio == 2 and not comp.overlap):  # not a fusion site: the graph path's one-kernel pooling
            compress(comp, proj, batch, cpool, backend=self.backend)
            return
        if not self.fused:  # the C2 fusion site, reference chain
            comp.pool(proj, batch, cpool)
            return
        from evalpipe.kernels import c2_verify

        r = self._rope(comp.rope)
        pools = batch.pools
        c2_verify(proj, batch.pos, batch.slot, batch.row_valid, comp.position_bias, comp.norm_w, comp.eps,
                  r.cos, r.sin, comp.rope.rope_dim, cpool.ring, cpool.entries, pools.page_table_on_device(),
                  pools.page_tokens // 2, cpool.ring_size, batch.groups[0].n, backend=self.backend)

    def moe(self, moe, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Routed experts read by device-side index (no sort, no host counts) plus the shared expert as one more
        pick: router GEMM, route, gate_up + SwiGLU, down + weighted sum (`step_moe`, 4 launches)."""
        return moe_forward(moe, x, input_ids, backend=self.backend)


class _Step:
    """One (bucket, width) static step: its input buffer, its output, and (on CUDA) its captured graph."""

    def __init__(self, owner: "GraphRunner", B: int, n: int):
        self.owner, self.B, self.n = owner, B, n
        pools, dev = owner.runner.pools, owner.runner.device
        size = 2 * B * n + 2 * B + pools.page_table.numel()
        self.meta = torch.zeros(size, dtype=torch.long, device=dev)
        self.page_table = self.meta[2 * B * n + 2 * B:].view_as(pools.page_table)
        ratios = sorted({c.ratio for p in pools.layers for c in (p.compressor, p.indexer) if c is not None})
        rings = sorted({pools.window_ring} | {c.ring_size for p in pools.layers for c in (p.compressor, p.indexer)
                                              if c is not None})
        model = owner.static_model.model
        hca = {layer.attn.ratio for layer in model.layers
               if layer.attn.compressor is not None and layer.attn.indexer is None}
        self.consts = {
            "rows": torch.arange(B * n, device=dev).view(B, n),
            "meta_shape": MetaShape(B=B, n=n, rings=tuple(rings), ratios=tuple(ratios),
                                    entries=tuple(pools.max_seq_len // r for r in ratios),
                                    hca_ratio=min(hca) if len(hca) == 1 else 0, page_tokens=pools.page_tokens,
                                    pages_per_seq=pools.pages_per_seq),
        }
        self.graph = None
        self.staging: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def _run(self) -> torch.Tensor:
        runner = self.owner.runner
        runner.pools._page_table_dev = self.page_table  # entry_rows() reads the table from this step's buffer
        batch = StaticBatch(runner.pools, self.meta, self.B, self.n, self.consts, self.owner.static_model.backend)
        return self.owner.static_model.forward(batch, runner.pools)

    def fill_padding(self) -> None:
        """Inputs that address only the pad slot: what warm-up and capture run on."""
        runner = self.owner.runner
        host = pack_step_inputs([[0] * self.n], [0], [self.owner.pad_slot], self.B, self.owner.pad_slot,
                                runner.pools.page_table)
        T = self.B * self.n
        host[T + 2 * self.B:2 * T + 2 * self.B] = 0  # row_valid: no live row at all
        self.meta.copy_(host)

    @torch.inference_mode()
    def capture(self) -> None:
        self.fill_padding()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compiles the Triton kernels, initialises cuBLAS handles
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.owner.mempool):
            self.logits = self._run()
        self.graph = graph

    def __call__(self, host_meta: torch.Tensor) -> torch.Tensor:
        if self.meta.is_cuda:  # through a pinned staging buffer: an async DMA instead of a pageable staged copy
            if self.staging is None:
                self.staging = torch.empty(self.meta.shape, dtype=self.meta.dtype, pin_memory=True)
                self.copied = torch.cuda.Event()
            else:  # the previous copy out of the staging buffer must be done before it is overwritten
                self.copied.synchronize()
            self.staging.copy_(host_meta)
            self.meta.copy_(self.staging, non_blocking=True)
            self.copied.record()
        else:
            self.meta.copy_(host_meta)
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            return self.logits
        self.logits = self._run()
        return self.logits


class GraphRunner:
    """A ModelRunner whose fixed-width forwards (decode, verify) run captured static steps. See module docstring."""

    def __init__(self, runner: Any, *, widths=(1,), buckets=DEFAULT_BUCKETS, fused: bool = True,
                 use_graphs: bool | None = None, kernel_backend: str = "auto"):
        self.runner = runner
        self.widths = tuple(sorted(set(int(w) for w in widths)))
        limit = runner.max_seqs - 1
        self.buckets = tuple(b for b in sorted(set(buckets)) if b <= limit) or (1,)
        self.fused = bool(fused)
        self.use_graphs = runner.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need device cuda")
        for ring in [runner.pools.window_ring] + [c.ring_size for p in runner.pools.layers
                                                   for c in (p.compressor, p.indexer) if c is not None]:
            if max(self.widths) > ring:
                raise ValueError(f"width {max(self.widths)} exceeds ring size {ring}; raise rollback_margin")
        self.pad_slot = runner.allocate()  # never reserves pages: its page-table row stays the trash page
        self.static_model = StaticModel(runner.model, fused=self.fused, kernel_backend=kernel_backend)
        self.mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps: dict[tuple[int, int], _Step] = {}

    def __getattr__(self, name):  # the rest of the ModelRunner interface
        return getattr(self.runner, name)

    @property
    def eager_runner(self) -> Any:
        """The wrapped ModelRunner (drafter views are built on it, not on the graph wrapper)."""
        return self.runner

    @property
    def max_seqs(self) -> int:
        return self.runner.max_seqs - 1  # one slot is the padding slot

    def step_for(self, batch: int, width: int) -> _Step:
        key = (bucket_for(batch, self.buckets), width)
        if key not in self.steps:
            step = _Step(self, *key)
            if self.use_graphs:
                step.capture()
            self.steps[key] = step
        return self.steps[key]

    def capture_all(self) -> None:
        """Capture every (bucket, width) step now (server start-up) instead of on first use."""
        for b in self.buckets:
            for w in self.widths:
                self.step_for(b, w)

    def graphable(self, seqs: list[int], tokens: list[list[int]]) -> bool:
        return (bool(seqs) and len(seqs) == len(tokens) and len(seqs) <= self.buckets[-1]
                and len({len(t) for t in tokens}) == 1 and len(tokens[0]) in self.widths)

    @torch.inference_mode()
    def forward(self, seqs: list[int], tokens: list[list[int]], *, all_logits: bool = False,
                **kwargs) -> torch.Tensor:
        if kwargs or not self.graphable(seqs, tokens) or self.pad_slot in seqs:
            return self.runner.forward(seqs, tokens, all_logits=all_logits, **kwargs)
        r = self.runner
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence may appear only once per forward")
        n, vocab = len(tokens[0]), r.config.vocab_size
        starts = []
        for seq, toks in zip(seqs, tokens):
            r._check(seq)
            if any(not 0 <= t < vocab for t in toks):
                raise ValueError(f"sequence {seq}: token id out of range [0, {vocab})")
            start = len(r._tokens[seq])
            if start + n > r.max_seq_len:
                raise ValueError(f"sequence {seq}: length {start + n} exceeds max_seq_len {r.max_seq_len}")
            starts.append(start)
        r.pools.reserve({seq: s + n for seq, s in zip(seqs, starts)})
        step = self.step_for(len(seqs), n)
        host = pack_step_inputs(tokens, starts, seqs, step.B, self.pad_slot, r.pools.page_table)
        logits = step(host).view(step.B, n, -1)[: len(seqs)]
        logits = (logits.reshape(len(seqs) * n, -1) if all_logits else logits[:, -1]).clone()
        for seq, toks in zip(seqs, tokens):
            r._tokens[seq].extend(int(t) for t in toks)
        return logits

    def describe(self) -> dict:
        d = self.runner.describe()
        d["cuda_graphs"] = {"enabled": self.use_graphs, "buckets": list(self.buckets), "widths": list(self.widths),
                            "captured": sorted(f"{b}x{w}" for b, w in self.steps), "fused": self.fused,
                            "pad_slot": self.pad_slot}
        return d


def serving_runner(runner_factory, *, device: str, max_batch: int, speculative: str = "off", block_size: int = 5,
                   fused: bool = True, cuda_graphs: bool = True, capture: bool = True) -> Any:
    """The server's runner: on CUDA a GraphRunner (decode and, with speculation, (G+1)-row verify steps for every
    bucket up to max_batch, captured at start-up when `cuda_graphs`); on the CPU the plain ModelRunner (the fused
    kernels and graphs are CUDA-only). `runner_factory(max_seqs)` builds the ModelRunner; one extra slot is the
    padding slot."""
    if device != "cuda":
        return runner_factory(max_batch)
    runner = runner_factory(max_batch + 1)
    widths = (1,) + ((block_size + 1,) if speculative == "block" else ())
    buckets = tuple(sorted(set(b for b in DEFAULT_BUCKETS if b < max_batch) | {max_batch}))
    graph = GraphRunner(runner, widths=widths, buckets=buckets, fused=fused, use_graphs=cuda_graphs)
    if capture:
        graph.capture_all()
    return graph


def capture_drafter(decoder: Any, target: Any) -> bool:
    """Give a model drafter (layerskip:N, self, model:PATH -- a RunnerDrafter over its own runner) captured one-row
    decode steps like the target's, so the G sequential draft forwards replay graphs too. The n-gram drafter has no
    model: nothing to capture. Returns whether the drafter's runner was wrapped."""
    drafter = getattr(decoder, "drafter", None)
    inner = getattr(drafter, "runner", None)
    if not isinstance(target, GraphRunner) or inner is None or isinstance(inner, GraphRunner):
        return False
    if getattr(drafter, "forward_kwargs", None) or not hasattr(inner, "pools") or not hasattr(inner, "model"):
        return False
    graph = GraphRunner(inner, widths=(1,), buckets=target.buckets, fused=target.fused,
                        use_graphs=target.use_graphs, kernel_backend=target.static_model.backend)
    if graph.use_graphs:
        graph.capture_all()
    drafter.runner = graph
    return True
