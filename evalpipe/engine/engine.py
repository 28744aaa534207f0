"""The engine: scheduler + runner + sampling, stepped by the engine process's loop (engine/loop.py).

`Engine.step()` is one forward: the scheduler's prompt chunks plus the decode rows of every running sequence,
then sampling (commit.py: the step's logits become committed tokens) and the output half (output.py: text, stop checks,
logprobs and one `SeqEvent` per advanced sequence). The runner and the decoder are the contracts of engine/contracts.py.
How decode rows are proposed and turned into committed tokens is delegated to the `Decoder`; `PlainDecoder`
(plain_decoder.py) feeds the last token and samples one. A speculative decoder plugs in at the same place: `propose`
returns the last token plus drafts (`width` rows), `accept` verifies them against the target rows, rolls the runner
back, and returns the tokens it committed. `prepare(seqs)` is called once per step with all decoding sequences, before
`propose`, and `release(slot)` when a sequence's runner slot is given back.
A runner whose `prefix_cache` is set starts admitted sequences from their cached prefix and indexes prompt pages as
they are prefilled; `flush_cache` is called between steps.

Overlap schedule (runners with `decodes_async`, i.e. the CUDA-graph runner): a step in which every sequence decodes
one greedy row, without grammar or logprobs, is queued without waiting for its tokens. The next such step feeds
those tokens on the device and is queued first; only then are the previous step's tokens read, emitted and checked
for stops, so the host's bookkeeping runs while the device computes (SGLang's overlap scheduler). A sequence that
stops on a stop token or string is one step late to know it: its extra row is discarded. One whose last token by
length is in flight sits the next step out. A new request or an abort settles the step in flight first, so such
steps see exact state.

A sequence whose params carry a grammar gets a `GrammarMatcher` (engine/grammar.py) at submit. The engine masks its
rows before anything samples from them: the first token after the prompt, and every row a decoder verifies (the
decoder stays grammar-blind), then commits the tokens the decoder returned to the matcher. The grammar's end is the
stop token, so such a sequence always stops there.
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import TYPE_CHECKING, Callable

import torch

from evalpipe.engine import commit, faults, output
from evalpipe.engine.contracts import Decoder, Runner
from evalpipe.engine.device_loss import check_device
from evalpipe.engine.grammar import Grammars
from evalpipe.engine.ipc import SeqEvent
from evalpipe.engine.plain_decoder import PlainDecoder
from evalpipe.engine.sampling import generator_for
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import QueueFull, Scheduler, Sequence, Status, StepBatch
from evalpipe.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from evalpipe.engine.static.graphs import PendingTokens

log = logging.getLogger("evalpipe.engine")

__all__ = ["Engine", "PlainDecoder", "Decoder", "Runner", "QueueFull"]


class Engine:
    """Owns the runner. Single-threaded: the engine process calls `submit`, `abort`, `flush_cache` and `step` in turn
    (tests step it directly)."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        *,
        max_batch: int = 64,
        max_tokens_per_step: int = 512,
        max_queue: int = 1024,
        decoder: Decoder | None = None,
        exhausted: tuple[type[BaseException], ...] = (),
        overlap: bool = True,
        prefill_delay_factor: float = 0.0,
        stream_interval: int = 1,
        clock: Callable[[], float] = time.monotonic,
        keyed_sampling: bool = False,
        debug_faults: tuple[str, ...] = (),
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.decoder = decoder or PlainDecoder()
        self.eos_token_id = _eos_id(runner, tokenizer)
        vocab = runner.config.vocab_size or tokenizer.vocab_size
        self.grammars = Grammars(tokenizer, int(vocab))  # compiles nothing until a request asks for a grammar
        self.scheduler = Scheduler(
            self._allocate_slot,
            self._free_slot,
            max_batch=max_batch,
            max_tokens_per_step=max_tokens_per_step,
            max_queue=max_queue,
            decode_width=self.decoder.width,
            exhausted=exhausted,
            attach=self._attach_prefix if runner.prefix_cache is not None else None,
        )
        self.allocated_slots = 0
        self.last_step_at = 0.0  # time.monotonic() of the last completed forward
        self.stats = {
            "requests": 0,
            "steps": 0,
            "overlapped_steps": 0,
            "prefill_steps": 0,
            "prompt_tokens": 0,
            "prefilled_tokens": 0,
            "generated_tokens": 0,
            "aborted": 0,
            "cached_tokens": 0,
        }
        self._aborts: list[Sequence] = []
        self.overlap = bool(overlap) and runner.decodes_async
        if prefill_delay_factor < 0:
            raise ValueError("prefill_delay_factor must be >= 0")
        self.prefill_delay_factor = float(prefill_delay_factor)
        if int(stream_interval) < 1:
            raise ValueError("stream_interval must be >= 1")
        self.stream_interval = int(stream_interval)
        self._clock = clock
        # sampled requests draw keyed noise (engine/keyed.py): a token depends on its distribution and (seed, index)
        self.keyed_sampling = bool(keyed_sampling)
        self._last_prefill = (0.0, 0.0)  # (end, seconds) of the last step that fed prompt chunks
        self._inflight: tuple[list[Sequence], PendingTokens] | None = None  # overlap: a queued step
        self.debug_faults = tuple(debug_faults)  # planted faults that act in the engine (engine/faults.py)

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request; raises QueueFull (nothing queued) when the queue is full."""
        for seq in seqs:
            seq.generator = generator_for(seq.params, self.runner.device, keyed=self.keyed_sampling)
            seq.detokenizer = self.tokenizer.detokenizer()
            if seq.params.grammar is not None:
                seq.matcher = self.grammars.matcher(seq.params.grammar, self.decoder.width)
        self.scheduler.add(seqs)
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += sum(len(s.prompt) for s in seqs)

    def abort(self, seqs: list[Sequence]) -> None:
        """Cancel sequences (client gone); their runner slots are freed before the next forward."""
        for seq in seqs:
            if seq.status is not Status.FINISHED and not seq.aborted:
                seq.aborted = True
                self._aborts.append(seq)

    @property
    def busy(self) -> bool:
        """Whether a `step` has anything to do."""
        return bool(self._aborts or self.scheduler.running or self.scheduler.waiting or self._inflight)

    def flush_cache(self) -> dict:
        """Drop the runner's prefix cache (between two steps; sequences in flight keep the pages they hold)."""
        if self.runner.prefix_cache is None:
            return {"enabled": False, "flushed_pages": 0}
        return self.runner.prefix_cache.flush()

    def fail_all(self, reason: str, error: str | None = None) -> None:
        """Finish every queued and running sequence (a failed step outside the forward, or shutdown)."""
        self._inflight = None
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, reason, error=error)

    def grammar_blocker(self) -> str | None:
        """Why this engine cannot decode under a grammar, or None. An acceptance rule that commits drafts without
        the exact test (lossy rules, simulated acceptance) could commit a token the grammar forbids."""
        return self.decoder.grammar_blocker()

    def describe(self) -> dict:
        return {
            "overlap": self.overlap,
            "sampling_noise": "keyed" if self.keyed_sampling else "stream",
            "running": self.scheduler.num_running,
            "waiting": self.scheduler.num_waiting,
            "allocated_slots": self.allocated_slots,
            "stats": dict(self.stats),
        }

    # -- one step ----------------------------------------------------------------------------------
    def step(self) -> int:
        """Run one forward over the scheduled rows; returns how many sequences took part (0: nothing to do)."""
        admit = self._admit_now()
        if self._inflight is not None and not self._can_chain(admit):
            self._settle()
        for seq in self._aborts:
            if seq.status is not Status.FINISHED:
                self.stats["aborted"] += 1
                self._finish(seq, "abort", notify=False)
        self._aborts.clear()
        batch = self.scheduler.schedule(admit=admit)
        if batch.empty:
            return 0
        if self._async_ok(batch):
            return self._step_async(batch.decodes)
        if self._inflight is not None:  # not reached when _can_chain held (a pure decode batch); exact state anyway
            self._settle()
            batch.decodes = [seq for seq in batch.decodes if seq.status is Status.RUNNING]
            if batch.empty:
                return 0
        slots: list[int] = []
        rows: list[list[int]] = []
        for chunk in batch.prefills:
            slots.append(chunk.seq.slot)
            rows.append(chunk.tokens)
        try:
            if batch.decodes:
                self.decoder.prepare(batch.decodes)
            for seq in batch.decodes:
                slots.append(seq.slot)
                rows.append(self.decoder.propose(seq))
            if self.debug_faults:
                faults.plant_device_assert(
                    self.debug_faults, {seq.params.seed for seq in _seqs_of(batch)}, self.runner.device
                )
            started = self._clock()
            all_logits = self.decoder.all_logits or any(
                c.seq.params.prompt_logprobs is not None for c in batch.prefills
            )
            logits = self.runner.forward(slots, rows, all_logits=all_logits, prompt_chunks=len(batch.prefills))
            self._cache_prompts(batch)
            committed = self._commit_tokens(batch, rows, logits, all_logits)
        except Exception as exc:  # keep serving: fail this step's sequences, not the server
            self._fail_step(_seqs_of(batch), exc)
            return len(batch.prefills) + len(batch.decodes)
        self.stats["steps"] += 1
        if batch.prefills:
            self.stats["prefill_steps"] += 1
            self.stats["prefilled_tokens"] += sum(len(chunk.tokens) for chunk in batch.prefills)
            now = self._clock()
            self._last_prefill = (now, now - started)
        self.last_step_at = time.monotonic()
        for seq, (tokens, logit_rows) in committed.items():
            if not seq.aborted and seq.status is Status.RUNNING:
                self._emit(seq, tokens, logit_rows)
        return len(batch.prefills) + len(batch.decodes)

    # -- overlap schedule --------------------------------------------------------------------------
    def _async_ok(self, batch: StepBatch) -> bool:
        """Whether this step may be queued without reading its tokens now (see the module docstring)."""
        return (
            self.overlap
            and not batch.prefills
            and self.decoder.one_row_greedy
            and self.runner.can_decode_async(len(batch.decodes))
            and all(_greedy_plain(seq.params) for seq in batch.decodes)
        )

    def _admit_now(self) -> bool:
        """Whether this step may admit waiting prompts. With a prefill delay factor F > 0, while sequences decode,
        new prompts wait until F x (the last prompt step's time) has passed since it ended, unless a full chunk of
        them is waiting: fewer, larger prompt chunks, each of which stalls every decoding row (vLLM's scheduler
        delay factor). Without a free batch place nothing can be admitted."""
        sched = self.scheduler
        if not sched.waiting or len(sched.running) >= sched.max_batch:
            return False
        if self.prefill_delay_factor == 0 or all(seq.prefilling for seq in sched.running):
            return True
        if sum(len(seq.prompt) for seq in sched.waiting) >= sched.max_tokens_per_step:
            return True
        end, took = self._last_prefill
        return self._clock() - end >= self.prefill_delay_factor * took

    def _can_chain(self, admit: bool) -> bool:
        """Whether the next step may be queued behind the one in flight, fed its tokens on the device: nothing to
        admit (`admit`) or abort, every running sequence in the step in flight, and one of them still going after it
        (a sequence whose last token by length is in flight sits the next step out; a stop token or stop string
        found late only wastes a row)."""
        if self._aborts or admit:
            return False
        seqs, running = set(self._inflight[0]), self.scheduler.running
        max_len = self._max_len()
        return seqs.issuperset(running) and not all(_last_in_flight(seq, max_len) for seq in running)

    def _step_async(self, decodes: list[Sequence]) -> int:
        previous = self._inflight
        fed = set(previous[0]) if previous is not None else set()
        max_len = self._max_len()  # read once: this filter runs over every sequence of every overlapped step
        decodes = [seq for seq in decodes if not (seq in fed and _last_in_flight(seq, max_len))]
        if not decodes:  # every sequence's last token is in flight (_can_chain settles first; kept safe anyway)
            self._settle()
            return 0
        tokens = [None if seq in fed else seq.last_token for seq in decodes]
        try:
            pending = self.runner.decode_async([seq.slot for seq in decodes], tokens)
        except Exception as exc:  # keep serving: fail this step's sequences, not the server
            self._inflight = None
            self._fail_step(decodes, exc)
            return len(decodes)
        self._inflight = (list(decodes), pending)
        self.stats["steps"] += 1
        self.stats["overlapped_steps"] += 1
        if previous is not None:
            self._settle(previous)
        return len(decodes)

    def _fail_step(self, seqs: list[Sequence], exc: Exception) -> None:
        """Finish a failed step's sequences with its error. First, raise DeviceLost (engine/device_loss.py) when the
        failure left the device unable to run anything (the engine process then exits, and the server fails every
        request in flight)."""
        log.error("engine step failed:\n%s", traceback.format_exc())
        self.check_device()
        for seq in seqs:
            self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def check_device(self) -> None:
        """Raise DeviceLost when the runner's device can run nothing more (a sticky CUDA error)."""
        check_device(self.runner.device)

    def _settle(self, inflight: tuple[list[Sequence], PendingTokens] | None = None) -> None:
        """Read a queued step's tokens (default: the one in flight) and emit them; a sequence finished since it was
        queued (stopped one step earlier, aborted) drops its row."""
        if inflight is None:
            inflight, self._inflight = self._inflight, None
        seqs, pending = inflight
        tokens = self.runner.settle(pending)
        self.last_step_at = time.monotonic()
        for seq, token in zip(seqs, tokens):
            if not seq.aborted and seq.status is Status.RUNNING:
                self._emit(seq, [token], None)

    def _attach_prefix(self, seq: Sequence) -> int:
        if seq.params.prompt_logprobs is not None:  # every prompt row must be computed to be scored
            return 0
        cached = self.runner.prefix_cache.attach(seq.slot, seq.prompt)
        self.stats["cached_tokens"] += cached
        return cached

    def _cache_prompts(self, batch: StepBatch) -> None:
        """Prompt tokens are final once fed: index the full pages they complete for later requests."""
        cache = self.runner.prefix_cache
        if cache is not None:
            for chunk in batch.prefills:
                if chunk.seq.slot is not None:
                    cache.cache(chunk.seq.slot, chunk.seq.num_prefilled)

    def _commit_tokens(
        self, batch: StepBatch, rows: list[list[int]], logits: torch.Tensor, all_logits: bool
    ) -> dict[Sequence, tuple[list[int], torch.Tensor]]:
        return commit.commit_tokens(batch, rows, logits, all_logits, self.decoder, self.eos_token_id)

    # -- output processing (engine/output.py) -----------------------
    def _emit(self, seq: Sequence, tokens: list[int], logit_rows: torch.Tensor | None) -> None:
        taken, reason = output.advance(seq, tokens, self.eos_token_id, self._max_len())
        delta = output.take_text(seq, finished=reason is not None)
        lps = output.logprob_entries(seq.params, taken, logit_rows)
        self.stats["generated_tokens"] += len(taken)
        if reason is not None:
            self._finish(seq, reason, notify=False)
        event = SeqEvent(
            index=seq.index,
            token_ids=taken,
            text=delta,
            logprobs=lps,
            completion_tokens=len(seq.output),
            finish_reason=reason,
            matched_stop=seq.matched_stop if reason else None,
            spec=self.decoder.stats(seq),
            cached_tokens=seq.cached_tokens,
            prompt_logprobs=seq.prompt_logprobs,
        )
        output.deliver(seq, event, self.stream_interval)
        seq.prompt_logprobs = None

    def _finish(self, seq: Sequence, reason: str, *, notify: bool = True, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        if notify:
            event = SeqEvent(
                index=seq.index,
                token_ids=[],
                text="",
                logprobs=None,
                completion_tokens=len(seq.output),
                finish_reason=reason,
                spec=self.decoder.stats(seq),
                error=error,
                cached_tokens=seq.cached_tokens,
            )
            output.deliver(seq, event, self.stream_interval)

    def _allocate_slot(self) -> int:
        slot = self.runner.allocate()
        self.allocated_slots += 1
        return slot

    def _free_slot(self, slot: int) -> None:
        self.decoder.release(slot)
        self.runner.free(slot)
        self.allocated_slots -= 1

    def _max_len(self) -> int:
        return self.runner.max_seq_len


def _seqs_of(batch: StepBatch) -> list[Sequence]:
    """A step's sequences: those its prompt chunks feed, then the decoding ones."""
    return [chunk.seq for chunk in batch.prefills] + batch.decodes


def _last_in_flight(seq: Sequence, max_len: int) -> bool:
    """Whether the token in flight for `seq` is its last by max_tokens or the length limit `max_len`."""
    done = len(seq.output) + 1
    return done >= seq.params.max_tokens or len(seq.prompt) + done >= max_len


def _greedy_plain(params: SamplingParams) -> bool:
    """A sequence whose next token is the argmax and nothing but the token: what an overlapped step can serve."""
    return params.greedy and params.grammar is None and params.logprobs is None and params.min_tokens == 0


def _eos_id(runner: Runner, tokenizer: Tokenizer) -> int | None:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = runner.config.eos_token_id
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos
