"""What one sequence is sampled with: plain data, torch-free, so the HTTP process builds it and sends it to the
engine process (engine/ipc.py `Submit`) without importing torch; engine/sampling.py turns it into probabilities and
draws."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from evalpipe.engine.grammar_constraint import GrammarConstraint


@dataclass(frozen=True)
class SamplingParams:
    """What one sequence (one choice) is sampled with; validated by the server before it gets here."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob plus the top k
    grammar: GrammarConstraint | None = None  # engine/grammar_constraint.py: every sampled row is masked to it
    # EOS and stop_token_ids are masked out, and stop strings unchecked, until this many tokens are out (vLLM's rule)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # keep a matched stop string (or stop token's text) in the text
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob (the first: None) + top k

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def bans_stops(self, generated: int) -> bool:
        """Whether the token after `generated` output tokens may not be EOS or a stop token (min_tokens)."""
        return generated < self.min_tokens


def draw_seed() -> int:
    """A fresh request seed (63 bits from the OS): what a sampled request without one is seeded with under keyed
    sampling (`--deterministic`), so the seed can be reported and the request replayed."""
    return secrets.randbits(63)
