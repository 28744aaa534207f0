"""The engine's parts as written contracts: what `Engine` (engine.py) calls on its runner and on its decoder.

- `Runner`: the model half. `ModelRunner` (runner.py) and `GraphRunner` (static/graphs.py) implement it. Two
  capabilities are optional and asked for by value, never by name: `prefix_cache` (None, or a `PrefixCaching`
  object) and `decodes_async` (whether `decode_async`/`settle`, the overlap schedule's calls, are offered).
- `Decoder`: how running sequences advance by one step. `PlainDecoder` (plain_decoder.py) feeds the last token and
  samples one; `SpeculativeDecoder` (spec/decoder.py) proposes drafts and verifies them. `prepare` and `release` are
  hooks that do nothing unless a decoder needs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from evalpipe.engine.scheduler import Sequence


class PrefixCaching(Protocol):
    """A runner's prefix cache (runner.py `RunnerPrefixCache`)."""

    def attach(self, seq: int, tokens: list[int]) -> int:
        """Start the empty sequence `seq` from the longest cached prefix of `tokens`; returns the tokens it holds."""

    def cache(self, seq: int, upto: int) -> None:
        """Index the full pages of the first `upto` (final) tokens of `seq`."""

    def flush(self) -> dict: ...

    def describe(self) -> dict: ...


class ModelConfig(Protocol):
    """The model configuration fields the engine reads (transformers' DeepseekV4Config has them)."""

    vocab_size: int
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    num_hidden_layers: int

    def to_dict(self) -> dict: ...


class Runner(Protocol):
    """Slots holding sequences of tokens, and one batched forward that appends rows to any of them."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_seq_len: int
    model_name: str
    model_path: str
    fused_sites: dict | None
    prefix_cache: PrefixCaching | None

    @property
    def max_seqs(self) -> int: ...

    @property
    def decodes_async(self) -> bool:
        """True: the runner also offers `can_decode_async`, `decode_async` and `settle` (GraphRunner)."""

    @property
    def eager_runner(self) -> Runner:
        """The runner whose forward is the plain eager one (itself, or the ModelRunner a GraphRunner wraps)."""

    def allocate(self) -> int: ...

    def free(self, seq: int) -> None: ...

    def seq_len(self, seq: int) -> int: ...

    def tokens(self, seq: int) -> list[int]: ...

    def forward(
        self, seqs: list[int], tokens: list[list[int]], *, all_logits: bool = False, prompt_chunks: int = 0
    ) -> torch.Tensor:
        """Append `tokens[i]` to `seqs[i]` in one pass; logits of every row (all_logits) or of each last row. The
        first `prompt_chunks` requests are prompt chunks (the engine says so; a runner with two paths keeps them on
        its prompt path when deterministic)."""

    def truncate(self, seq: int, new_len: int) -> None: ...

    def describe(self) -> dict: ...


class Decoder:
    """How running sequences advance by one step. Subclasses give `propose`, `accept`, `stats` and `describe`."""

    width: int = 1  # rows per sequence per step
    all_logits: bool = False  # the runner must return every row's logits, not only each sequence's last one
    one_row_greedy: bool = False  # propose is [last token] and greedy accept its argmax: a step may be overlapped

    def prepare(self, seqs: list[Sequence]) -> None:
        """Called once per step with every decoding sequence, before `propose` (e.g. draft all of them at once)."""

    def propose(self, seq: Sequence) -> list[int]:
        raise NotImplementedError

    def accept(
        self,
        seq: Sequence,
        logits: torch.Tensor,
        argmax: list[int] | None = None,
        samples: list[int] | None = None,
    ) -> list[int]:
        """Commit tokens from this sequence's rows; `argmax` (greedy sequences without a grammar) is the rows'
        argmax, already on the host; `samples` (keyed sampling, when `takes_samples(seq)`) the rows' keyed samples."""
        raise NotImplementedError

    def takes_samples(self, seq: Sequence) -> bool:
        """Whether `accept` decides this keyed-sampled sequence from its rows' keyed samples alone, so the step may
        draw them for all such sequences at once (engine/commit.py)."""
        return False

    def release(self, slot: int) -> None:
        """The sequence in runner slot `slot` is gone: drop any state kept for it."""

    def stats(self, seq: Sequence) -> dict | None:
        return None

    def grammar_blocker(self) -> str | None:
        """Why sequences under a grammar cannot be decoded this way, or None."""
        return None

    def describe(self) -> dict:
        raise NotImplementedError
