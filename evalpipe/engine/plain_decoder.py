"""The decoder without speculation: one row per sequence, the last committed token fed, the next one sampled."""

from __future__ import annotations

import torch

from evalpipe.engine.contracts import Decoder
from evalpipe.engine.sampling import sample_token
from evalpipe.engine.scheduler import Sequence


class PlainDecoder(Decoder):
    """One row per sequence: feed the last committed token, sample the next one."""

    width = 1
    all_logits = False
    one_row_greedy = True

    def __init__(self, debug_faults: tuple[str, ...] = ()):
        self.debug_faults = tuple(debug_faults)  # planted bugs that act outside speculation (engine/faults.py)

    def propose(self, seq: Sequence) -> list[int]:
        return [seq.last_token]

    def accept(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        argmax: list[int] | None = None,
        samples: list[int] | None = None,
    ) -> list[int]:
        if argmax is not None:
            return [argmax[-1]]
        if samples is not None:
            return [samples[-1]]
        return [sample_token(logits[-1], seq.params, seq.generator, len(seq.output))]

    def takes_samples(self, seq: Sequence) -> bool:
        return True

    def stats(self, seq: Sequence) -> dict | None:
        return {"debug_faults": list(self.debug_faults)} if self.debug_faults else None

    def describe(self) -> dict:
        return {
            "mode": "off",
            "simulate_acc_len": None,
            **({"debug_faults": list(self.debug_faults)} if self.debug_faults else {}),
        }
