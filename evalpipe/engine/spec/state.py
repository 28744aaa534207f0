"""`SeqSpec`: the speculative decoder's state for one sequence (`Sequence.spec`), kept on the sequence so that its
statistics outlive the runner slot it is released from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from evalpipe.engine.spec.accept import SimulatedAcceptLengths, SpecStats


@dataclass
class SeqSpec:
    stats: SpecStats
    sim: SimulatedAcceptLengths | None
    drafts: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # the distributions the drafts were drawn from (sampled requests)
    base_len: int = 0  # target length (committed tokens - 1) when the current block was drafted
