"""Preallocated per-request state pools and the page table that addresses them.

A request (sequence slot) owns:
  * fixed-size rings, indexed by `slot * R + position % R` (one region per slot):
      - the sliding-window KV ring of every layer (R = sliding_window - 1 + rollback_margin),
      - the compressor ring of every CSA/HCA layer and of every CSA indexer: the *projected* rows
        `[kv | gate]` (before position bias) that pending and overlapping windows still need
        (R = look-back + rollback_margin, look-back = 2*ratio with overlap (CSA), ratio without (HCA));
  * a list of pages (page table row) for the compressed-KV entries and indexer keys: page p of a request covers
    positions [p*P, (p+1)*P), i.e. P/ratio entries of each compressed layer;
  * a length.

With the prefix cache on (`prefix_tails=True`, engine/prefix_cache.py) pages are shared: `page_refs` counts the
sequences whose page table holds a page, a full page may also be indexed by the cache (then it is parked in the
cache's LRU instead of freed when its last holder lets go), and every page keeps a *tail*: per ring, the values the
ring held for the last `min(look-back, P)` positions of the page. A sequence that starts from a cached boundary b
(a page edge, so a multiple of every ratio) gets the shared pages in its page table and its rings rebuilt from the
tails of the pages before b: exactly the state a fresh history of the same tokens leaves (the invariant below).

Invariant (why rollback needs no undo pass): every state cell is addressed by absolute position, never by "how
many were appended". After any sequence of forwards ending at length L, ring slot `position % R` holds the value
computed from the token prefix [0..position] for every position in [L - R, L), and compressed entry w is final for
every w < L // ratio. A forward starting at position s reads ring positions [s - look-back, s) and entries
w < (s + n) // ratio only, writing the same cells it would write on a fresh history. So truncating to L' keeps the
state valid as long as L - L' <= rollback_margin (the rings still hold [L' - look-back, L')); the runner falls back
to re-prefilling the kept prefix for deeper rollbacks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from evalpipe.engine.host_to_device import to_device
from evalpipe.engine.model.config import CSA, SLIDING, compress_ratio


class PoolExhausted(RuntimeError):
    """No free sequence slot or no free page: the scheduler should wait for a request to finish."""


@dataclass
class CompressorPool:
    ratio: int
    lookback: int  # positions before a forward's first row that its windows may still need
    ring_size: int
    ring: torch.Tensor  # [max_seqs * ring_size, 2 * proj_dim] projected (kv | gate) rows
    entries: torch.Tensor  # [(num_pages + 1) * P // ratio, entry_dim]; the last page is a write sink
    tail: torch.Tensor | None = None  # [(num_pages + 1) * tail_rows, 2 * proj_dim]: ring rows at each page's end
    tail_rows: int = 0  # min(lookback, P)


@dataclass
class LayerPool:
    window: torch.Tensor  # [max_seqs * Rw, head_dim] sliding-window K(=V) ring
    window_tail: torch.Tensor | None = None  # [(num_pages + 1) * window_tail_rows, head_dim] (prefix cache only)
    compressor: CompressorPool | None = None
    indexer: CompressorPool | None = None


class StatePools:
    def __init__(
        self,
        config,
        *,
        max_seqs: int,
        max_seq_len: int,
        device,
        dtype,
        rollback_margin: int = 32,
        page_tokens: int | None = None,
        num_pages: int | None = None,
        prefix_tails: bool = False,
    ):
        self.max_seqs, self.max_seq_len, self.margin = max_seqs, max_seq_len, rollback_margin
        self.device, self.dtype = torch.device(device), dtype
        ratios = [compress_ratio(config, t) for t in config.layer_types if t != SLIDING]
        lcm = math.lcm(*ratios) if ratios else 1
        self.page_tokens = page_tokens or lcm * max(1, math.ceil(64 / lcm))
        if any(self.page_tokens % r for r in ratios):
            raise ValueError(f"page_tokens {self.page_tokens} must be a multiple of every compress ratio {ratios}")
        self.pages_per_seq = math.ceil(max_seq_len / self.page_tokens)
        self.num_pages = num_pages if num_pages is not None else max_seqs * self.pages_per_seq
        self.trash_page = self.num_pages
        self.window_ring = config.sliding_window - 1 + rollback_margin
        self.page_table = torch.full((max_seqs, self.pages_per_seq), self.trash_page, dtype=torch.long)
        self._page_table_dev = None
        self.free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
        self.seq_pages: dict[int, list[int]] = {}
        self.page_refs = [0] * self.num_pages  # sequences holding each page in their page table
        self.cache = None  # the PrefixCache that indexes full pages (set by it), None: pages are never shared
        self.prefix_tails = bool(prefix_tails)
        self.window_tail_rows = min(config.sliding_window - 1, self.page_tokens)
        self.layers: list[LayerPool] = []
        kw = dict(device=self.device, dtype=dtype)
        for layer_type in config.layer_types:
            window = torch.zeros(max_seqs * self.window_ring, config.head_dim, **kw)
            pool = LayerPool(window, self._tail(self.window_tail_rows, config.head_dim, **kw))
            if layer_type != SLIDING:
                r = compress_ratio(config, layer_type)
                overlap = layer_type == CSA
                pool.compressor = self._compressor_pool(r, overlap, config.head_dim, **kw)
                if layer_type == CSA:
                    pool.indexer = self._compressor_pool(r, True, config.index_head_dim, **kw)
            self.layers.append(pool)

    def _compressor_pool(self, ratio, overlap, entry_dim, **kw) -> CompressorPool:
        lookback = 2 * ratio if overlap else ratio
        ring_size = lookback + self.margin
        proj_dim = entry_dim * (2 if overlap else 1)
        ring = torch.zeros(self.max_seqs * ring_size, 2 * proj_dim, **kw)
        entries = torch.zeros((self.num_pages + 1) * self.page_tokens // ratio, entry_dim, **kw)
        tail_rows = min(lookback, self.page_tokens)
        return CompressorPool(
            ratio, lookback, ring_size, ring, entries, self._tail(tail_rows, 2 * proj_dim, **kw), tail_rows
        )

    def _tail(self, rows: int, dim: int, **kw) -> torch.Tensor | None:
        """Uninitialised on purpose: a tail row is read only after a forward wrote it (untouched memory of a large
        host allocation is never resident)."""
        return torch.empty((self.num_pages + 1) * rows, dim, **kw) if self.prefix_tails and rows else None

    # ---- page allocation -------------------------------------------------------------------------------------
    def pages_needed(self, seq: int, length: int) -> int:
        return max(0, math.ceil(length / self.page_tokens) - len(self.seq_pages.get(seq, [])))

    def reserve(self, wants: dict[int, int]) -> None:
        """Give each seq enough pages for its new length, all or nothing (PoolExhausted leaves nothing changed)."""
        # counted once per sequence (every decode step reserves for every row); eviction takes only parked pages,
        # which no sequence holds, so the counts stay right
        needs = [(seq, self.pages_needed(seq, length)) for seq, length in wants.items()]
        total = sum(n for _, n in needs)
        if total > len(self.free_pages):
            evictable = self.cache.evictable if self.cache is not None else 0
            if total > len(self.free_pages) + evictable:
                raise PoolExhausted(f"need {total} pages, {len(self.free_pages)} free, {evictable} evictable")
            self.cache.evict(total - len(self.free_pages))  # least recently used cached pages first
        added = []  # (seq, column, page): one page-table write for all (a batch in step needs pages together)
        for seq, n in needs:
            pages = self.seq_pages.setdefault(seq, [])
            for _ in range(n):
                page = self.free_pages.pop()
                self.page_refs[page] = 1
                added.append((seq, len(pages), page))
                pages.append(page)
        if added:
            seqs, columns, new = zip(*added)
            self.page_table[list(seqs), list(columns)] = torch.tensor(new, dtype=torch.long)
            self._page_table_dev = None

    def share(self, seq: int, pages: list[int]) -> None:
        """Give an empty sequence existing (cached) pages as its first pages, by reference."""
        if self.seq_pages.get(seq):
            raise ValueError(f"sequence {seq} already holds pages")
        self.seq_pages[seq] = list(pages)
        for i, page in enumerate(pages):
            if self.page_refs[page] == 0:
                self.cache.unpark(page)
            self.page_refs[page] += 1
            self.page_table[seq, i] = page
        self._page_table_dev = None

    def shrink(self, seq: int, length: int) -> None:
        """Return the pages past `length` (a rollback or a free)."""
        pages = self.seq_pages.get(seq, [])
        keep = math.ceil(length / self.page_tokens)
        while len(pages) > keep:
            page = pages.pop()
            self.page_table[seq, len(pages)] = self.trash_page
            self._page_table_dev = None
            self.page_refs[page] -= 1
            if self.page_refs[page] > 0:
                continue  # still another sequence's
            if self.cache is not None and self.cache.holds(page):
                self.cache.park(page)  # kept for later hits until evicted
            else:
                self.free_pages.append(page)

    def release_page(self, page: int) -> None:
        """A cached page nobody holds leaves the cache (evicted or flushed): back to the free list."""
        if self.page_refs[page] == 0:
            self.free_pages.append(page)

    # ---- tails (prefix cache) --------------------------------------------------------------------------------
    def _rings(self):
        """(ring, ring_size, tail, tail_rows, look-back) of every ring that has a tail."""
        for pool in self.layers:
            if pool.window_tail is not None:
                yield (
                    pool.window,
                    self.window_ring,
                    pool.window_tail,
                    self.window_tail_rows,
                    self.window_ring - self.margin,
                )
            for comp in (pool.compressor, pool.indexer):
                if comp is not None and comp.tail is not None:
                    yield comp.ring, comp.ring_size, comp.tail, comp.tail_rows, comp.lookback

    def _ring_tail_index(
        self,
        seq: int,
        pages: list[int],
        start: int,
        end: int,
        ring_size: int,
        tail_rows: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring cells, tail rows) of the positions [start, end) of `seq` that the tails keep."""
        P = self.page_tokens
        x = torch.arange(max(0, start), end)
        x = x[x % P >= P - tail_rows]
        page = torch.tensor(pages, dtype=torch.long)[x // P]
        return self._tail_cells(seq, page, x, ring_size, tail_rows)

    def _tail_cells(
        self, seq: int | torch.Tensor, page: torch.Tensor, pos: torch.Tensor, ring_size: int, tail_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layout of rings and tails, on the device: (ring cells, tail rows) of positions `pos` (each in the
        last tail_rows of its page `page`) of sequences `seq`, broadcast together and flattened."""
        P = self.page_tokens
        cells = seq * ring_size + pos % ring_size
        rows = page * tail_rows + pos % P - (P - tail_rows)
        index = torch.stack([cells.reshape(-1), rows.reshape(-1)])
        index = to_device(index, self.device)  # queued behind the step in flight instead of waiting for it
        return index[0], index[1]

    def restore_rings(self, seq: int, boundary: int) -> None:
        """Rebuild the rings of `seq` at length `boundary` (a page edge) from the tails of its first pages."""
        pages, memo = self.seq_pages[seq], {}
        for ring, size, tail, tail_rows, lookback in self._rings():
            key = (size, tail_rows, lookback)
            if key not in memo:
                memo[key] = self._ring_tail_index(seq, pages, boundary - lookback, boundary, size, tail_rows)
            cells, tails = memo[key]
            if cells.numel():
                ring.index_copy_(0, cells, tail[tails])

    def tails_before(self, seq: int, start: int, end: int) -> None:
        """Before an eager forward that takes `seq` from `start` to `end` and writes the tails of its own rows: copy
        from the rings the tail rows of the first page edge it crosses that lie before `start` (they may come from
        static steps, which write only the rings; the rings still hold them, being at most a tail behind)."""
        if not self.prefix_tails:
            return
        P = self.page_tokens
        edge = (start // P + 1) * P
        if edge > end or start % P == 0:
            return
        pages, memo = self.seq_pages[seq], {}
        for ring, size, tail, tail_rows, _ in self._rings():
            if edge - tail_rows >= start:
                continue
            if (size, tail_rows) not in memo:
                memo[size, tail_rows] = self._ring_tail_index(seq, pages, edge - tail_rows, start, size, tail_rows)
            cells, tails = memo[size, tail_rows]
            tail.index_copy_(0, tails, ring[cells])

    def tails_from_rings(self, spans: list[tuple[int, int, int]]) -> None:
        """After a forward that took each `(seq, start, end)` of `spans` from `start` to `end` rows without writing
        tails itself (the static step): copy each crossed page's tail from the rings, which still hold it while
        end - edge <= rollback_margin. One index and one copy per ring for the whole step: a batch that decodes in
        step crosses its page edges together (C sequences every page_tokens steps), and per sequence that was
        dozens of small tensor ops (kernel launches and pinned copies on a GPU) each."""
        if not self.prefix_tails:
            return
        P = self.page_tokens
        crossed = []  # (seq, the page that ends at the edge, edge)
        for seq, start, end in spans:
            for edge in range((start // P + 1) * P, end + 1, P):
                if end - edge > self.margin:
                    raise ValueError(f"page edge {edge} is no longer in the rings at length {end}")
                crossed.append((seq, self.seq_pages.get(seq, [])[edge // P - 1], edge))
        if not crossed:
            return
        edges = torch.tensor(crossed, dtype=torch.long)
        memo = {}
        for ring, size, tail, tail_rows, _ in self._rings():
            if (size, tail_rows) not in memo:
                memo[size, tail_rows] = self._edge_tail_index(edges, size, tail_rows)
            cells, tails = memo[size, tail_rows]
            tail.index_copy_(0, tails, ring[cells])  # pages being written are private: no two rows share a tail row

    def _edge_tail_index(
        self, edges: torch.Tensor, ring_size: int, tail_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring cells, tail rows) of the last `tail_rows` positions before each edge of `edges` (rows of seq, page,
        edge): `_ring_tail_index` over [edge - tail_rows, edge), for every edge at once."""
        seq, page, edge = edges[:, :1], edges[:, 1:2], edges[:, 2:]
        return self._tail_cells(seq, page, edge - tail_rows + torch.arange(tail_rows), ring_size, tail_rows)

    def use_device_page_table(self, table: torch.Tensor) -> None:
        """Read the page table from `table` (a static step's copy inside its input buffer, on the device) until the
        next page-table change."""
        self._page_table_dev = table

    def page_table_on_device(self) -> torch.Tensor:
        if self._page_table_dev is None:
            self._page_table_dev = to_device(self.page_table, self.device)
        return self._page_table_dev

    def entry_rows(self, slots: torch.Tensor, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        """Pool row of compressed entry `entries` (any shape, broadcast with slots[..., None]) of each slot."""
        per_page = self.page_tokens // ratio
        table = self.page_table_on_device()
        page_col = (entries * ratio) // self.page_tokens
        page_col = page_col.clamp(max=self.pages_per_seq - 1)
        pages = table[slots.view(-1, *([1] * (entries.dim() - 1))), page_col]
        return pages * per_page + entries % per_page

    # ---- inspection (tests, rollback checks) -----------------------------------------------------------------
    def describe(self) -> dict:
        nbytes = sum(t.numel() * t.element_size() for t in self._tensors())
        cached = self.cache.evictable if self.cache is not None else 0
        return {
            "max_seqs": self.max_seqs,
            "max_seq_len": self.max_seq_len,
            "page_tokens": self.page_tokens,
            "num_pages": self.num_pages,
            "free_pages": len(self.free_pages) + cached,
            "cached_idle_pages": cached,
            "window_ring": self.window_ring,
            "rollback_margin": self.margin,
            "state_bytes": nbytes,
        }

    def _tensors(self):
        for pool in self.layers:
            yield pool.window
            if pool.window_tail is not None:
                yield pool.window_tail
            for comp in (pool.compressor, pool.indexer):
                if comp is not None:
                    yield comp.ring
                    yield comp.entries
                    if comp.tail is not None:
                        yield comp.tail
