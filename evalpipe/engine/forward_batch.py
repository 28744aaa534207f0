"""Per-forward row metadata: the new rows of all requests flattened request-major, plus the gather indices every
layer needs (computed once per forward and shared by all layers with the same ring size or ratio).

Requests are attended in groups (`group_requests`): requests of the same number of new rows share one (all decodes
are one group; all k+1-row verifies are one group), and so do prompt chunks of lengths within a factor of
PAD_FACTOR, padded on the query axis to the group's longest: a padding row repeats its request's last row (same
id, same position), so it reads only what that row reads and nothing is written for it. Each group costs the
attention, compressor and indexer ops of every layer once, whatever its size, so a step that prefills a dozen
prompts of a dozen lengths would otherwise launch them a dozen times."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evalpipe.engine.cache import StatePools
from evalpipe.engine.host_to_device import to_device


@dataclass
class Group:
    n: int  # new rows per request (a padded group's longest)
    slots: torch.Tensor  # [G]
    starts: torch.Tensor  # [G] position of the first new row
    rows: torch.Tensor  # [G, n] flattened row ids (padding: the request's last row again)
    pos: torch.Tensor  # [G, n] absolute positions (padding: that row's)
    memo: dict = field(default_factory=dict)
    host_starts: list[int] | None = None  # the starts on the host, when known: shape decisions without a sync
    # padded groups only: each request's own count of new rows (host, device), the flat indices into [G * n] of the
    # rows that are not padding, and those rows' batch rows
    host_counts: list[int] | None = None
    counts: torch.Tensor | None = None
    real: torch.Tensor | None = None
    real_rows: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.slots.shape[0]

    @property
    def padded(self) -> bool:
        return self.real is not None

    def ends(self) -> torch.Tensor:
        """[G] each request's length after this forward (start + its own count)."""
        return self.starts + (self.counts if self.counts is not None else self.n)

    def host_ends(self) -> list[int]:
        counts = self.host_counts or [self.n] * len(self.host_starts)
        return [s + c for s, c in zip(self.host_starts, counts)]

    def scatter(self, out: torch.Tensor, values: torch.Tensor) -> None:
        """Write this group's per-row results `values` [G, n, ...] into the batch-row tensor `out` [T, ...],
        padding rows left out."""
        if self.real is None:
            out[self.rows] = values
        else:
            out[self.real_rows] = values.reshape(-1, *values.shape[2:])[self.real]


PAD_FACTOR = 2  # a padded group's rows are at most this many times its real rows, per request


def group_requests(counts: list[int], pad_factor: int = PAD_FACTOR) -> list[list[int]]:
    """Request indices grouped for attention: by descending count, a request joins the open group while its count
    is at least 1 / pad_factor of the group's longest (1: equal counts only, no padding), and each group lists its
    requests in batch order."""
    groups: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(counts)), key=lambda i: -counts[i]):
        if not groups or counts[i] * pad_factor < longest:
            groups.append([])
            longest = counts[i]
        groups[-1].append(i)
    return [sorted(g) for g in groups]


class RowRope:
    """Per-row RoPE factors of a batch (`self.pos` positions, `self._rope` memo): shared by the eager forward batch
    and the CUDA-graph static batch."""

    _rope: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    pos: torch.Tensor

    def rope(self, table) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, -sin) of every row for a rope table, gathered once per forward."""
        key = id(table)
        if key not in self._rope:
            sin = table.sin[self.pos]
            self._rope[key] = (table.cos[self.pos], sin, -sin)
        return self._rope[key]


class ForwardBatch(RowRope):
    def __init__(
        self,
        pools: StatePools,
        slots: list[int],
        starts: list[int],
        counts: list[int],
        input_ids: torch.Tensor,
        *,
        pad_groups: bool = True,
    ):
        """`pad_groups=False`: one group per distinct count, no padding (--deterministic: a row's numbers must not
        depend on which requests share its forward)."""
        dev = pools.device
        self.pools = pools
        self.input_ids = input_ids
        self.num_rows = int(sum(counts))
        offsets = [0]
        for c in counts:
            offsets.append(offsets[-1] + c)
        self.last_rows = to_device(torch.tensor([o - 1 for o in offsets[1:]]), dev)
        counts_t = torch.tensor(counts)
        row_req = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
        starts_t, slots_t = torch.tensor(starts), torch.tensor(slots)
        row_pos = starts_t[row_req] + torch.arange(self.num_rows) - torch.tensor(offsets[:-1])[row_req]
        self.pos, self.slot = to_device(row_pos, dev), to_device(slots_t[row_req], dev)
        self.groups: list[Group] = []
        first_row = torch.tensor(offsets[:-1])
        for reqs in group_requests(counts, PAD_FACTOR if pad_groups else 1):
            idx = torch.tensor(reqs)
            own = counts_t[idx]
            n = int(own.max())
            col = torch.arange(n)[None]
            rows = first_row[idx][:, None] + torch.minimum(col, own[:, None] - 1)  # padding: the last row again
            group = Group(
                n,
                to_device(slots_t[idx], dev),
                to_device(starts_t[idx], dev),
                to_device(rows, dev),
                to_device(row_pos[rows], dev),
                host_starts=[starts[i] for i in reqs],
            )
            if bool((own < n).any()):
                real = (col < own[:, None]).flatten().nonzero().squeeze(1)
                group.host_counts = own.tolist()
                group.counts = to_device(own, dev)
                group.real = to_device(real, dev)
                group.real_rows = to_device(rows.flatten()[real], dev)
            self.groups.append(group)
        self._host_pos, self._host_slot = row_pos, slots_t[row_req]
        self._host_end = (starts_t + counts_t)[row_req]  # length of the row's request after this forward
        self._ring_writes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tail_writes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def ring_writes(self, ring_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, ring cells) to store after a layer: each request's last `ring_size` new rows at
        `slot * ring_size + position % ring_size` (earlier rows would be overwritten in the same scatter). Computed
        on the host: a device-side selection would wait for the GPU mid-forward."""
        if ring_size not in self._ring_writes:
            rows = (self._host_pos >= self._host_end - ring_size).nonzero().squeeze(1)
            cells = self._host_slot[rows] * ring_size + self._host_pos[rows] % ring_size
            dev = self.pools.device
            self._ring_writes[ring_size] = (to_device(rows, dev), to_device(cells, dev))
        return self._ring_writes[ring_size]

    def tail_writes(self, tail_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, tail cells) of the rows that fall in the last `tail_rows` positions of their page (prefix cache:
        cache.py); the pages are already reserved, so the host page table addresses them."""
        if tail_rows not in self._tail_writes:
            P = self.pools.page_tokens
            offset = self._host_pos % P
            keep = (offset >= P - tail_rows).nonzero().squeeze(1)
            pages = self.pools.page_table[self._host_slot[keep], self._host_pos[keep] // P]
            cells = pages * tail_rows + offset[keep] - (P - tail_rows)
            dev = self.pools.device
            self._tail_writes[tail_rows] = (to_device(keep, dev), to_device(cells, dev))
        return self._tail_writes[tail_rows]


def window_keys_index(group: Group, ring_size: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring cells of the `window - 1` positions before each request's first new row, and the mask
    [G, n, 1, window] of each query's window keys that do not exist (position < 0)."""
    key = ("window", ring_size, window)
    if key not in group.memo:
        past = group.starts[:, None] - (window - 1) + torch.arange(window - 1, device=group.starts.device)[None]
        cells = group.slots[:, None] * ring_size + past % ring_size
        key_pos = group.pos[:, :, None] - (window - 1) + torch.arange(window, device=group.pos.device)
        group.memo[key] = (cells, (key_pos < 0).unsqueeze(2))  # [G, n, 1, W] True = hidden
    return group.memo[key]


@dataclass
class WindowPlan:
    """Where the compression windows completed by this forward read their rows and write their entry."""

    past_cells: torch.Tensor  # [G, lookback] ring cells of positions start-lookback .. start-1
    cur: torch.Tensor  # [G, nw, ratio] index into cat(past, new) of the window's rows
    prev: torch.Tensor | None  # [G, nw, ratio] same for the previous window (overlap only)
    has_prev: torch.Tensor | None  # [G, nw] window index >= 1
    entry_pos: torch.Tensor  # [G, nw] absolute position of the window start (RoPE position of the entry; padding: any)
    out_rows: torch.Tensor  # [G, nw] pool rows to write (trash page for padding windows)


def window_plan(
    group: Group, pools: StatePools, ratio: int, lookback: int, ring_size: int, overlap: bool
) -> WindowPlan | None:
    """None when no request of the group completes a window (3 of 4 decode steps at ratio 4)."""
    key = ("plan", ratio, lookback, ring_size, overlap)
    if key in group.memo:
        return group.memo[key]
    if group.host_starts is not None:
        nw = max(e // ratio - s // ratio for s, e in zip(group.host_starts, group.host_ends()))
        if nw == 0:
            group.memo[key] = None
            return None
    else:  # device-only metadata (static/graph steps): the fixed upper bound, padding windows go to trash
        nw = group.n // ratio + 1
    dev = group.starts.device
    start, n = group.starts, group.n
    base = start - lookback  # position of index 0 of cat(past, new)
    past = base[:, None] + torch.arange(lookback, device=dev)[None]
    past_cells = group.slots[:, None] * ring_size + past % ring_size
    first = start // ratio
    w = first[:, None] + torch.arange(nw, device=dev)[None]  # [G, nw]
    valid = w < (group.ends() // ratio)[:, None]
    slots_in = torch.arange(ratio, device=dev)
    limit = lookback + n - 1
    cur = (w[..., None] * ratio + slots_in - base[:, None, None]).clamp(0, limit)
    prev = has_prev = None
    if overlap:
        prev = ((w[..., None] - 1) * ratio + slots_in - base[:, None, None]).clamp(0, limit)
        has_prev = w >= 1
    rows = pools.entry_rows(group.slots, w, ratio)
    trash = pools.trash_page * (pools.page_tokens // ratio)
    out_rows = torch.where(valid, rows, torch.full_like(rows, trash))
    # a padding window (past its request's end: a padded group runs its longest request's count) may lie past the
    # RoPE table; its entry goes to trash, so it takes its request's first window's position instead
    entry_pos = torch.where(valid, w * ratio, (first * ratio)[:, None])
    plan = WindowPlan(past_cells, cur, prev, has_prev, entry_pos, out_rows)
    group.memo[key] = plan
    return plan


def entry_index(group: Group, pools: StatePools, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool rows [G, E] of entries 0..E-1 (E = most entries any request of the group has after this forward) and
    the causal visibility [G, n, E] of entry w to the query at position t: w < (t + 1) // ratio."""
    key = ("entries", ratio)
    if key not in group.memo:
        dev = group.starts.device
        if group.host_starts is not None:
            count = max(e // ratio for e in group.host_ends())
        else:
            count = int((group.ends() // ratio).max())
        w = torch.arange(count, device=dev)
        rows = pools.entry_rows(group.slots, w[None].expand(group.size, -1), ratio)
        visible = w[None, None] < ((group.pos + 1) // ratio)[..., None]
        group.memo[key] = (rows, visible)
    return group.memo[key]


def entry_mask(group: Group, pools: StatePools, ratio: int) -> torch.Tensor:
    """[G, n, 1, E] True where an entry is not (yet) visible to the query: the attention mask of entry_index."""
    key = ("entry_mask", ratio)
    if key not in group.memo:
        group.memo[key] = (~entry_index(group, pools, ratio)[1]).unsqueeze(2)
    return group.memo[key]
