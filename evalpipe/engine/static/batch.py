"""The static step's inputs: one persistent int64 buffer per (bucket, width) and the batch view the layers read.

Everything a step needs from the host goes through one buffer filled by a single host-to-device copy (token ids,
starts, slots, row-valid flags and the page table, `pack_step_inputs`); everything else is derived on the device
inside the step (every index array in one kernel, `kernels.step_meta`). Batches are padded with *whole* requests:
a padding request uses the reserved `pad_slot` (its own ring regions, no pages, so its page-table row is the trash
page), position 0.., and row_valid 0. Every write is addressed by the row's own metadata (ring cell slot*R + pos %
R, entry rows through the slot's page-table row, or gated by row_valid in the fused C2 kernel), so a padding row
never touches a live request's state. Compressed entries are addressed over the fixed maximum count
(max_seq_len // ratio) with the causal visibility mask, instead of the live count (which needs a host read).
"""

from __future__ import annotations

import array

import torch

from evalpipe.engine.forward_batch import Group, RowRope
from evalpipe.kernels.step_meta import step_meta


def pack_step_inputs(
    tokens: list[list[int]], starts: list[int], slots: list[int], bucket: int, pad_slot: int, page_table: torch.Tensor
) -> torch.Tensor:
    """The step's one input buffer (int64, on the host): ids [B*n] | starts [B] | slots [B] | row_valid [B*n] |
    page table. Requests past len(tokens) are padding: token 0, start 0, `pad_slot`, row_valid 0."""
    n = len(tokens[0])
    if any(len(t) != n for t in tokens):
        raise ValueError("every request of a static step feeds the same number of rows")
    pad = bucket - len(tokens)
    if pad < 0:
        raise ValueError(f"{len(tokens)} requests do not fit bucket {bucket}")
    ids = [t for toks in tokens for t in toks] + [0] * (pad * n)
    head = ids + list(starts) + [0] * pad + list(slots) + [pad_slot] * pad + [1] * (len(tokens) * n) + [0] * (pad * n)
    # through an int64 array: torch.tensor converts a list element by element (~30 us for a 64-row step's head)
    head = torch.frombuffer(array.array("q", head), dtype=torch.long)
    return torch.cat([head, page_table.reshape(-1).to(torch.long)])


class StaticBatch(RowRope):
    """The `ForwardBatch` interface over device buffers of fixed shape: B requests of n rows, one group."""

    def __init__(self, pools, meta: torch.Tensor, B: int, n: int, consts: dict, backend: str = "auto"):
        T = B * n
        self.pools, self.num_rows = pools, T
        self.input_ids = meta[:T]
        starts, slots = meta[T : T + B], meta[T + B : T + 2 * B]
        self.row_valid = meta[T + 2 * B : 2 * T + 2 * B] != 0
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
