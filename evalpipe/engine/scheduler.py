"""Continuous batching: which sequences advance in the next forward, and by how many rows.

Every step, each sequence that has finished its prompt gets `decode_width` rows (1 for plain decoding, G+1
for a speculative verify); the rest of the `max_tokens_per_step` row budget goes to prompt chunks, first of
sequences already admitted, then of new ones taken FIFO from the waiting queue while fewer than `max_batch`
are running and the runner still has a free slot. A newly admitted sequence first asks `attach` how many of its
prompt tokens the runner already holds (a prefix-cache hit) and prefills only the rest. The queue is bounded: `add`
raises `QueueFull` beyond
`max_queue` waiting sequences. Runner slots are taken at admission and given back at once on finish or abort.
`make_sequences` builds the `Sequence`s of one request (its n choices).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Callable

import torch

from evalpipe.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from evalpipe.engine.grammar import GrammarMatcher
    from evalpipe.engine.ipc import SeqEvent
    from evalpipe.engine.keyed import KeyedNoise
    from evalpipe.engine.spec.state import SeqSpec
    from evalpipe.engine.tokenizer import Detokenizer

# Prompt rows a step always offers when prompts are pending, even if decode rows use the whole budget,
# so that a full decode batch cannot starve a newly admitted prompt.
MIN_PREFILL_ROWS = 16


class QueueFull(RuntimeError):
    """More sequences are waiting than `max_queue` allows; the server answers 503 with Retry-After."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One choice of one request: its prompt, what it has generated, where its state lives in the runner, and the
    engine's output state (text so far, what was streamed, stop-string search, grammar, speculation)."""

    prompt: list[int]
    params: SamplingParams
    index: int = 0  # choice index within its request
    on_event: Callable[[SeqEvent], None] | None = None  # called by the engine with each SeqEvent
    id: int = field(default_factory=lambda: next(_ids))
    status: Status = Status.WAITING
    slot: int | None = None  # runner sequence handle while RUNNING
    num_prefilled: int = 0  # prompt tokens already fed to the runner
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache at admission (usage.prompt_tokens_details)
    output: list[int] = field(default_factory=list)
    generator: torch.Generator | KeyedNoise | None = None  # engine/sampling.py generator_for (None: greedy)
    aborted: bool = False
    finish_reason: str | None = None
    matched_stop: int | str | None = None
    # output state, set by Engine.submit and advanced by Engine._emit
    detokenizer: Detokenizer | None = None
    text: str = ""  # detokenized output (cut before a matched stop string)
    sent: int = 0  # characters of `text` already sent
    checked: int = 0  # characters of `text` already searched for stop strings
    stop_from: int = 0  # stop strings match only from here (text after the first min_tokens tokens)
    matcher: GrammarMatcher | None = None  # the grammar's matcher, when params.grammar is set
    prompt_logprobs: list | None = None  # scored prompt tokens not yet sent (params.prompt_logprobs)
    held: SeqEvent | None = None  # an event held back by the stream interval
    spec: SeqSpec | None = None  # the speculative decoder's per-sequence state (engine/spec/state.py)

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.prompt)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]


@dataclass
class PrefillChunk:
    seq: Sequence
    tokens: list[int]
    last: bool  # this chunk ends the prompt: its final row's logits give the first generated token


@dataclass
class StepBatch:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(
        self,
        allocate: Callable[[], int],
        free: Callable[[int], None],
        *,
        max_batch: int = 64,
        max_tokens_per_step: int = 512,
        max_queue: int = 1024,
        decode_width: int = 1,
        exhausted: tuple[type[BaseException], ...] = (),
        attach: Callable[[Sequence], int] | None = None,
    ):
        if max_batch < 1 or max_tokens_per_step < 1 or max_queue < 0:
            raise ValueError("max_batch and max_tokens_per_step must be >= 1, max_queue >= 0")
        self._allocate = allocate
        self._free = free
        self._exhausted = exhausted  # exception types meaning "no slot now, try later"
        self._attach = attach  # admitted sequence -> prompt tokens already in its slot (prefix cache)
        self.max_batch = max_batch
        self.max_tokens_per_step = max_tokens_per_step
        self.max_queue = max_queue
        self.decode_width = decode_width
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    # -- admission and removal -------------------------------------------------------------------
    def add(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences together (all or none), FIFO."""
        if len(self.waiting) + len(seqs) > self.max_queue:
            raise QueueFull(f"{len(self.waiting)} sequences waiting; the queue holds {self.max_queue}")
        self.waiting.extend(seqs)

    def finish(self, seq: Sequence, reason: str | None = None) -> None:
        """Take a sequence out of the schedule and give its runner slot back now."""
        if seq.status is Status.FINISHED:
            return
        if reason is not None:
            seq.finish_reason = reason
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.slot is not None:
            self._free(seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED

    def abort(self, seq: Sequence) -> None:
        seq.aborted = True
        self.finish(seq, "abort")

    # -- planning ----------------------------------------------------------------------------------
    def schedule(self, admit: bool = True) -> StepBatch:
        """The next step's rows; `admit=False` leaves the waiting queue alone this step (the engine's prefill delay):
        admitted prompts still get their next chunks."""
        batch = StepBatch()
        prefilling: list[Sequence] = []  # one pass over the running sequences: every decode step schedules them all
        for seq in self.running:
            (prefilling if seq.prefilling else batch.decodes).append(seq)
        budget = self.max_tokens_per_step - self.decode_width * len(batch.decodes)
        pending = bool(prefilling) or (admit and bool(self.waiting))
        prefill_budget = max(budget, min(MIN_PREFILL_ROWS, self.max_tokens_per_step)) if pending else 0
        for seq in prefilling:
            if prefill_budget <= 0:
                break
            prefill_budget -= self._add_chunk(batch, seq, prefill_budget)
        while admit and prefill_budget > 0 and self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            try:
                slot = self._allocate()
            except self._exhausted:
                break
            self.waiting.popleft()
            seq.slot, seq.status = slot, Status.RUNNING
            self.running.append(seq)
            if self._attach is not None:
                seq.cached_tokens = seq.num_prefilled = self._attach(seq)
            prefill_budget -= self._add_chunk(batch, seq, prefill_budget)
        return batch

    @staticmethod
    def _add_chunk(batch: StepBatch, seq: Sequence, budget: int) -> int:
        start = seq.num_prefilled
        end = min(len(seq.prompt), start + budget)
        batch.prefills.append(PrefillChunk(seq, seq.prompt[start:end], last=end == len(seq.prompt)))
        seq.num_prefilled = end
        return end - start

    # -- introspection -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def describe(self) -> dict:
        return {
            "max_batch": self.max_batch,
            "max_tokens_per_step": self.max_tokens_per_step,
            "max_queue": self.max_queue,
            "decode_width": self.decode_width,
            "running": self.num_running,
            "waiting": self.num_waiting,
        }


def make_sequences(
    prompt: list[int],
    params: SamplingParams,
    n: int,
    on_event: Callable[[SeqEvent], None],
    first_index: int = 0,
) -> list[Sequence]:
    """n choices of one prompt; with a seed, choice i samples with seed + i so the choices differ yet repeat."""
    seqs = []
    for i in range(n):
        p = params if params.seed is None or i == 0 else _with_seed(params, params.seed + i)
        seqs.append(Sequence(prompt=list(prompt), params=p, index=first_index + i, on_event=on_event))
    return seqs


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
