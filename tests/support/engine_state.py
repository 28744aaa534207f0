"""What the rollback and static-step tests compare: the live state one sequence has in a runner's pools."""

from __future__ import annotations

import torch


def state_snapshot(runner, seq: int) -> dict[str, torch.Tensor]:
    """Copies of the live state of `seq`, ordered by position: what a fresh history of the same tokens must
    reproduce. Rings: the positions a next forward may read; entries: all final entries. `runner` is a ModelRunner
    or a GraphRunner (its wrapped runner holds the pools)."""
    pools = getattr(runner, "eager_runner", runner).pools
    length = runner.seq_len(seq)
    out = {}
    slot = torch.tensor([seq], device=pools.device)
    for i, pool in enumerate(pools.layers):
        pos = torch.arange(max(0, length - (pools.window_ring - pools.margin)), length, device=pools.device)
        out[f"layer{i}.window"] = pool.window[seq * pools.window_ring + pos % pools.window_ring]
        for name, comp in (("compressor", pool.compressor), ("indexer", pool.indexer)):
            if comp is None:
                continue
            ring = comp.ring_size
            pos = torch.arange(max(0, length - comp.lookback), length, device=pools.device)
            out[f"layer{i}.{name}.ring"] = comp.ring[seq * ring + pos % ring]
            rows = pools.entry_rows(slot, torch.arange(length // comp.ratio, device=pools.device)[None], comp.ratio)
            out[f"layer{i}.{name}.entries"] = comp.entries[rows[0]]
    return {k: v.clone() for k, v in out.items()}
