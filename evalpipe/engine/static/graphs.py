"""GraphRunner: a ModelRunner whose decode and verify forwards run the static step, captured as CUDA graphs.

A forward in which every sequence feeds the same number of rows n, with n one of `widths` (1 = decode, G+1 =
verify), and at most the largest bucket of sequences, runs the static step (engine/static/model.py) of bucket B (the
smallest bucket that fits). A mixed forward (a busy server's step: decode rows beside prompt chunks) is split: the
sequences that feed a graph width go through the static step, the rest (prompt chunks) through the wrapped runner,
and the logits come back in the caller's order; sequences are independent, so the split changes no result. Every
other forward goes to the wrapped runner unchanged.
On CUDA each (bucket, width) step is captured once into a `torch.cuda.CUDAGraph` (after two warm-up runs that
compile the Triton kernels) and replayed; the step contains no host synchronisation. On the CPU the same static
step runs eagerly (the "dry path"), which is what the CPU tests check against the plain runner.

`decode_async` / `settle` serve the engine's overlap schedule: a one-row greedy step queued without a host read,
whose input tokens may be the previous such step's argmax, copied on the device (`_feed_chosen`).

GraphRunner wraps a ModelRunner and works on it through its public methods only (`check_rows`, `append_tokens`,
`set_token`, its pools). It is the engine's `Runner` (engine/contracts.py) like the ModelRunner it wraps: the
bookkeeping calls (allocate, seq_len, tokens, truncate) and the attributes are the wrapped runner's, its prefix cache
capability is the wrapped runner's own object, and it adds the fixed-width forward, `max_seqs` (one slot less: the
padding slot), `free` (drops rows fed from the device) and the overlap calls. Anything else is the wrapped runner's
(`eager_runner`).
"""

from __future__ import annotations

import torch

from evalpipe.engine.model.deepseek_v4 import DeepseekV4Model
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.static.batch import StaticBatch, pack_step_inputs
from evalpipe.engine.static.model import StaticModel
from evalpipe.kernels.step_meta import MetaShape

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket_for(batch: int, buckets) -> int:
    """Smallest bucket that holds `batch` requests (ValueError past the largest)."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    raise ValueError(f"batch {batch} exceeds the largest graph bucket {max(buckets)}")


class _Step:
    """One (bucket, width) static step: its input buffer, its output, and (on CUDA) its captured graph."""

    def __init__(self, owner: "GraphRunner", B: int, n: int):
        self.owner, self.B, self.n = owner, B, n
        pools, dev = owner.runner.pools, owner.runner.device
        size = 2 * B * n + 2 * B + pools.page_table.numel()
        self.meta = torch.zeros(size, dtype=torch.long, device=dev)
        self.page_table = self.meta[2 * B * n + 2 * B :].view_as(pools.page_table)
        ratios = sorted({c.ratio for p in pools.layers for c in (p.compressor, p.indexer) if c is not None})
        rings = sorted(
            {pools.window_ring}
            | {c.ring_size for p in pools.layers for c in (p.compressor, p.indexer) if c is not None}
        )
        model = owner.static_model.model
        hca = {
            layer.attn.ratio
            for layer in model.layers
            if layer.attn.compressor is not None and layer.attn.indexer is None
        }
        self.consts = {
            "rows": torch.arange(B * n, device=dev).view(B, n),
            "meta_shape": MetaShape(
                B=B,
                n=n,
                rings=tuple(rings),
                ratios=tuple(ratios),
                entries=tuple(pools.max_seq_len // r for r in ratios),
                hca_ratio=min(hca) if len(hca) == 1 else 0,
                page_tokens=pools.page_tokens,
                pages_per_seq=pools.pages_per_seq,
            ),
        }
        self.graph = None
        self.staging: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def _run(self) -> torch.Tensor:
        runner = self.owner.runner
        runner.pools.use_device_page_table(self.page_table)  # entry_rows() reads the table from this step's buffer
        batch = StaticBatch(runner.pools, self.meta, self.B, self.n, self.consts, self.owner.static_model.backend)
        return self.owner.static_model.forward(batch, runner.pools)

    def fill_padding(self) -> None:
        """Inputs that address only the pad slot: what warm-up and capture run on."""
        runner = self.owner.runner
        host = pack_step_inputs(
            [[0] * self.n], [0], [self.owner.pad_slot], self.B, self.owner.pad_slot, runner.pools.page_table
        )
        T = self.B * self.n
        host[T + 2 * self.B : 2 * T + 2 * self.B] = 0  # row_valid: no live row at all
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

    def __call__(self, host_meta: torch.Tensor, before_replay=None) -> torch.Tensor:
        """Copy the inputs in, run `before_replay(self)` (device-side input edits, queued after the copy), replay."""
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
        if before_replay is not None:
            before_replay(self)
        if self.graph is not None:
            self.graph.replay()
            self.replays += 1
            return self.logits
        self.logits = self._run()
        return self.logits


class PendingTokens:
    """The greedy tokens of one `GraphRunner.decode_async` step: chosen on the device, read by `settle`. The read
    waits on an event recorded right after the step, not on the stream, so the next step may already be running."""

    def __init__(self, seqs: list[int], starts: list[int], host: torch.Tensor, event: torch.cuda.Event | None):
        self.seqs, self.starts, self.host, self.event = seqs, starts, host, event


class GraphRunner:
    """A ModelRunner whose fixed-width forwards (decode, verify) run captured static steps. See module docstring."""

    decodes_async = True

    def __init__(
        self,
        runner: ModelRunner,
        *,
        widths=(1,),
        buckets=DEFAULT_BUCKETS,
        fused: bool = True,
        use_graphs: bool | None = None,
        kernel_backend: str = "auto",
    ):
        self.runner = runner
        self.config, self.device, self.dtype = runner.config, runner.device, runner.dtype
        self.max_seq_len, self.model_name, self.model_path = runner.max_seq_len, runner.model_name, runner.model_path
        self.fused_sites = runner.fused_sites
        self.prefix_cache = runner.prefix_cache  # the capability object itself: it works on the wrapped runner
        self.allocate, self.seq_len, self.tokens = runner.allocate, runner.seq_len, runner.tokens
        self.truncate = runner.truncate
        self.widths = tuple(sorted(set(int(w) for w in widths)))
        limit = runner.max_seqs - 1
        self.buckets = tuple(b for b in sorted(set(buckets)) if b <= limit) or (1,)
        self.fused = bool(fused)
        self.use_graphs = runner.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need device cuda")
        for ring in [runner.pools.window_ring] + [
            c.ring_size for p in runner.pools.layers for c in (p.compressor, p.indexer) if c is not None
        ]:
            if max(self.widths) > ring:
                raise ValueError(f"width {max(self.widths)} exceeds ring size {ring}; raise rollback_margin")
        self.pad_slot = runner.allocate()  # never reserves pages: its page-table row stays the trash page
        self.static_model = StaticModel(runner.model, fused=self.fused, kernel_backend=kernel_backend)
        self.mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.steps: dict[tuple[int, int], _Step] = {}
        # decode_async: each slot's last greedy choice (on the device), where that choice goes in the slot's tokens,
        # and the placeholders (-1) a step fed from the device before its token reached the host
        self._chosen = torch.zeros(runner.max_seqs, dtype=torch.long, device=runner.device)
        self._chosen_at: dict[int, int] = {}
        self._placeholders: dict[int, int] = {}
        self.async_stats = {"steps": 0, "rows_fed_on_device": 0}

    @property
    def eager_runner(self) -> ModelRunner:
        """The wrapped ModelRunner (drafter views are built on it, not on the graph wrapper)."""
        return self.runner

    @property
    def model(self) -> DeepseekV4Model:
        return self.runner.model

    @property
    def max_seqs(self) -> int:
        return self.runner.max_seqs - 1  # one slot is the padding slot

    def free(self, seq: int) -> None:
        hole = self._placeholders.pop(seq, None)
        if hole is not None:  # a row fed from the device whose token never reached the host: not final, drop it
            self.runner.truncate(seq, hole)
        self._chosen_at.pop(seq, None)
        self.runner.free(seq)

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
        return (
            bool(seqs)
            and len(seqs) == len(tokens)
            and len(seqs) <= self.buckets[-1]
            and len({len(t) for t in tokens}) == 1
            and len(tokens[0]) in self.widths
        )

    def graph_part(self, tokens: list[list[int]], eager_first: int = 0) -> list[int]:
        """Indices of the requests of a mixed forward that the static step takes: those feeding the graph width
        most of them feed (at most the largest bucket), never one of the first `eager_first`; the others go
        through the wrapped runner."""
        by_width: dict[int, list[int]] = {}
        for i, t in enumerate(tokens):
            if i >= eager_first and len(t) in self.widths:
                by_width.setdefault(len(t), []).append(i)
        if not by_width:
            return []
        return max(by_width.values(), key=len)[: self.buckets[-1]]

    @torch.inference_mode()
    def forward(
        self, seqs: list[int], tokens: list[list[int]], *, all_logits: bool = False, prompt_chunks: int = 0, **kwargs
    ) -> torch.Tensor:
        """`prompt_chunks`: the first that many requests are prompt chunks. A deterministic model runs them through
        the wrapped runner whatever their length: a prompt row computes the same numbers in every chunking only on
        one path, and a chunk of a graph width (the 1-row rest after a prefix-cache hit) would take the other."""
        if kwargs or self.pad_slot in seqs:
            return self.runner.forward(seqs, tokens, all_logits=all_logits, **kwargs)
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence may appear only once per forward")
        eager_first = prompt_chunks if self.model.deterministic else 0
        if not eager_first and self.graphable(seqs, tokens):
            return self._static_forward(seqs, tokens, all_logits)
        part = self.graph_part(tokens, eager_first)
        if not part or len(part) == len(seqs):
            return self.runner.forward(seqs, tokens, all_logits=all_logits)
        return self._split_forward(seqs, tokens, all_logits, set(part))

    def can_decode_async(self, batch: int) -> bool:
        """Whether `batch` one-row greedy sequences fit a captured decode step (what `decode_async` runs)."""
        return 1 in self.widths and 0 < batch <= self.buckets[-1]

    @torch.inference_mode()
    def decode_async(self, seqs: list[int], tokens: list[int | None]) -> PendingTokens:
        """One greedy decode row per sequence, queued without waiting for the device (the engine's overlap
        schedule). A token None feeds the token the previous `decode_async` chose for that sequence, on the device:
        step N+1 is queued before step N's tokens reach the host. Until `settle(step N)` the runner holds -1 in its
        place. Returns the step's pending tokens."""
        r = self.runner
        if len(set(seqs)) != len(seqs):
            raise ValueError("a sequence may appear only once per forward")
        if not self.can_decode_async(len(seqs)) or len(seqs) != len(tokens):
            raise ValueError(f"decode_async takes 1..{self.buckets[-1]} sequences with one token each")
        starts = []
        for seq, tok in zip(seqs, tokens):
            start = r.check_rows(seq, [tok])
            if tok is None and self._chosen_at.get(seq) != start:
                raise ValueError(f"sequence {seq}: no token chosen by the previous decode_async to feed")
            starts.append(start)
        r.pools.reserve({seq: s + 1 for seq, s in zip(seqs, starts)})
        step = self.step_for(len(seqs), 1)
        B = step.B
        host = pack_step_inputs(
            [[-1 if t is None else t] for t in tokens], starts, seqs, B, self.pad_slot, r.pools.page_table
        )
        fed_from_device = sum(t is None for t in tokens)
        self.async_stats["steps"] += 1
        self.async_stats["rows_fed_on_device"] += fed_from_device
        logits = step(host, before_replay=self._feed_chosen if fed_from_device else None)
        chosen = logits.view(B, -1).argmax(-1)  # ties to the lowest id, as StepArgmax
        self._chosen.index_copy_(0, step.meta[2 * B : 3 * B], chosen)  # slots; the pad slot's entry is never read
        n = len(seqs)
        if chosen.is_cuda:
            host_ids = torch.empty(n, dtype=torch.long, pin_memory=True)
            host_ids.copy_(chosen[:n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host_ids, event = chosen[:n].clone(), None
        for seq, tok, start in zip(seqs, tokens, starts):
            r.append_tokens(seq, [-1 if tok is None else tok])
            if tok is None:
                self._placeholders[seq] = start
            self._chosen_at[seq] = start + 1
        r.pools.tails_from_rings([(seq, start, start + 1) for seq, start in zip(seqs, starts)])
        return PendingTokens(list(seqs), starts, host_ids, event)

    def settle(self, pending: PendingTokens) -> list[int]:
        """The tokens of a `decode_async` step on the host (waits for that step only); fills the placeholders that
        later steps fed from them."""
        if pending.event is not None:
            pending.event.synchronize()
        ids = pending.host.tolist()
        for seq, start, tok in zip(pending.seqs, pending.starts, ids):
            if self._placeholders.get(seq) == start + 1:
                self.runner.set_token(seq, start + 1, tok)
                del self._placeholders[seq]
        return ids

    def _feed_chosen(self, step: _Step) -> None:
        """Rows whose token is -1 take their slot's last chosen token, on the device."""
        B = step.B
        ids, slots = step.meta[:B], step.meta[2 * B : 3 * B]
        ids.copy_(torch.where(ids < 0, self._chosen[slots], ids))

    def _split_forward(
        self, seqs: list[int], tokens: list[list[int]], all_logits: bool, part: set[int]
    ) -> torch.Tensor:
        rest = [i for i in range(len(seqs)) if i not in part]
        fast = sorted(part)
        eager = self.runner.forward([seqs[i] for i in rest], [tokens[i] for i in rest], all_logits=all_logits)
        static = self._static_forward([seqs[i] for i in fast], [tokens[i] for i in fast], all_logits)
        rows = [len(t) if all_logits else 1 for t in tokens]
        pieces: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
        for block, order in ((eager, rest), (static, fast)):
            for piece, i in zip(block.split([rows[i] for i in order]), order):
                pieces[i] = piece
        return torch.cat(pieces)

    def _static_forward(self, seqs: list[int], tokens: list[list[int]], all_logits: bool) -> torch.Tensor:
        r = self.runner
        n = len(tokens[0])
        starts = [r.check_rows(seq, toks) for seq, toks in zip(seqs, tokens)]
        r.pools.reserve({seq: s + n for seq, s in zip(seqs, starts)})
        step = self.step_for(len(seqs), n)
        host = pack_step_inputs(tokens, starts, seqs, step.B, self.pad_slot, r.pools.page_table)
        logits = step(host).view(step.B, n, -1)[: len(seqs)]
        logits = (logits.reshape(len(seqs) * n, -1) if all_logits else logits[:, -1]).clone()
        for seq, toks in zip(seqs, tokens):
            r.append_tokens(seq, toks)
        r.pools.tails_from_rings([(seq, start, start + n) for seq, start in zip(seqs, starts)])  # it writes rings only
        return logits

    def describe(self) -> dict:
        d = self.runner.describe()
        d["cuda_graphs"] = {
            "enabled": self.use_graphs,
            "buckets": list(self.buckets),
            "widths": list(self.widths),
            "captured": sorted(f"{b}x{w}" for b, w in self.steps),
            "fused": self.fused,
            "pad_slot": self.pad_slot,
        }
        return d
