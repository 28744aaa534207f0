"""The engine: scheduler + runner + sampling, stepped by the engine process's loop (engine/loop.py).

`Engine.step()` is one forward: the scheduler's prompt chunks plus the decode rows of every running sequence,
then sampling, stop checks and one `SeqEvent` per advanced sequence. The runner and the decoder are the contracts
of engine/contracts.py. How decode rows are proposed and turned into committed tokens is delegated to the `Decoder`;
`PlainDecoder` feeds the last token and samples one. A speculative decoder plugs in at the same place: `propose`
returns the last token plus drafts (`width` rows), `accept` verifies them against the target rows, rolls the runner
back, and returns the tokens it committed. `prepare(seqs)` is called once per step with all decoding sequences,
before `propose`, and `release(slot)` when a sequence's runner slot is given back.
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
from dataclasses import replace
from typing import TYPE_CHECKING, Callable

import torch

from evalpipe.engine.contracts import Decoder, Runner
from evalpipe.engine.grammar import Grammars
from evalpipe.engine.ipc import SeqEvent
from evalpipe.engine.sampling import StepArgmax, generator_for, sample_token, token_logprobs
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import PrefillChunk, QueueFull, Scheduler, Sequence, Status, StepPlan
from evalpipe.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from evalpipe.engine.static.graphs import PendingTokens

log = logging.getLogger("evalpipe.engine")

__all__ = ["Engine", "PlainDecoder", "Decoder", "Runner", "QueueFull"]


class PlainDecoder(Decoder):
    """One row per sequence: feed the last committed token, sample the next one."""

    width = 1
    all_logits = False
    one_row_greedy = True

    def __init__(self, debug_faults: tuple[str, ...] = ()):
        self.debug_faults = tuple(debug_faults)  # planted bugs that act outside speculation (engine/faults.py)

    def propose(self, seq: Sequence) -> list[int]:
        return [seq.last_token]

    def accept(self, seq: Sequence, logits: torch.Tensor, argmax: list[int] | None = None) -> list[int]:
        if argmax is not None:
            return [argmax[-1]]
        return [sample_token(logits[-1], seq.params, seq.generator, len(seq.output))]

    def stats(self, seq: Sequence) -> dict | None:
        return {"debug_faults": list(self.debug_faults)} if self.debug_faults else None

    def describe(self) -> dict:
        return {
            "mode": "off",
            "simulate_acc_len": None,
            **({"debug_faults": list(self.debug_faults)} if self.debug_faults else {}),
        }


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
        """Run one forward over the planned rows; returns how many sequences took part (0: nothing to do)."""
        admit = self._admit_now()
        if self._inflight is not None and not self._can_chain(admit):
            self._settle()
        for seq in self._aborts:
            if seq.status is not Status.FINISHED:
                self.stats["aborted"] += 1
                self._finish(seq, "abort", notify=False)
        self._aborts.clear()
        plan = self.scheduler.schedule(admit=admit)
        if plan.empty:
            return 0
        if self._async_ok(plan):
            return self._step_async(plan.decodes)
        if self._inflight is not None:  # not reached when _can_chain held (a pure decode plan); exact state anyway
            self._settle()
            plan.decodes = [seq for seq in plan.decodes if seq.status is Status.RUNNING]
            if plan.empty:
                return 0
        slots: list[int] = []
        rows: list[list[int]] = []
        for chunk in plan.prefills:
            slots.append(chunk.seq.slot)
            rows.append(chunk.tokens)
        try:
            if plan.decodes:
                self.decoder.prepare(plan.decodes)
            for seq in plan.decodes:
                slots.append(seq.slot)
                rows.append(self.decoder.propose(seq))
            started = self._clock()
            all_logits = self.decoder.all_logits or any(c.seq.params.prompt_logprobs is not None for c in plan.prefills)
            logits = self.runner.forward(slots, rows, all_logits=all_logits, prompt_chunks=len(plan.prefills))
            self._cache_prompts(plan)
            committed = self._commit_tokens(plan, rows, logits, all_logits)
        except Exception as exc:  # keep serving: fail this step's sequences, not the server
            log.error("engine step failed:\n%s", traceback.format_exc())
            for seq in [c.seq for c in plan.prefills] + plan.decodes:
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
            return len(plan.prefills) + len(plan.decodes)
        self.stats["steps"] += 1
        if plan.prefills:
            self.stats["prefill_steps"] += 1
            self.stats["prefilled_tokens"] += sum(len(chunk.tokens) for chunk in plan.prefills)
            now = self._clock()
            self._last_prefill = (now, now - started)
        self.last_step_at = time.monotonic()
        for seq, (tokens, logit_rows) in committed.items():
            if not seq.aborted and seq.status is Status.RUNNING:
                self._emit(seq, tokens, logit_rows)
        return len(plan.prefills) + len(plan.decodes)

    # -- overlap schedule --------------------------------------------------------------------------
    def _async_ok(self, plan: StepPlan) -> bool:
        """Whether this step may be queued without reading its tokens now (see the module docstring)."""
        return (
            self.overlap
            and not plan.prefills
            and self.decoder.one_row_greedy
            and self.runner.can_decode_async(len(plan.decodes))
            and all(_greedy_plain(seq.params) for seq in plan.decodes)
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
        return all(seq in seqs for seq in running) and not all(self._ends_in_flight(seq) for seq in running)

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """Whether the token in flight for `seq` is its last by max_tokens or the length limit."""
        done = len(seq.output) + 1
        return done >= seq.params.max_tokens or len(seq.prompt) + done >= self._max_len()

    def _step_async(self, decodes: list[Sequence]) -> int:
        previous = self._inflight
        fed = set(previous[0]) if previous is not None else set()
        decodes = [seq for seq in decodes if not (seq in fed and self._ends_in_flight(seq))]
        if not decodes:  # every sequence's last token is in flight (_can_chain settles first; kept safe anyway)
            self._settle()
            return 0
        tokens = [None if seq in fed else seq.last_token for seq in decodes]
        try:
            pending = self.runner.decode_async([seq.slot for seq in decodes], tokens)
        except Exception as exc:  # keep serving: fail this step's sequences, not the server
            log.error("engine step failed:\n%s", traceback.format_exc())
            self._inflight = None
            for seq in decodes:
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
            return len(decodes)
        self._inflight = (list(decodes), pending)
        self.stats["steps"] += 1
        self.stats["overlapped_steps"] += 1
        if previous is not None:
            self._settle(previous)
        return len(decodes)

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

    def _cache_prompts(self, plan: StepPlan) -> None:
        """Prompt tokens are final once fed: index the full pages they complete for later requests."""
        cache = self.runner.prefix_cache
        if cache is not None:
            for chunk in plan.prefills:
                if chunk.seq.slot is not None:
                    cache.cache(chunk.seq.slot, chunk.seq.num_prefilled)

    def _commit_tokens(
        self, plan: StepPlan, rows: list[list[int]], logits: torch.Tensor, all_logits: bool
    ) -> dict[Sequence, tuple[list[int], torch.Tensor]]:
        """Sample the first token of each finished prompt and let the decoder advance the decoding sequences."""
        out: dict[Sequence, tuple[list[int], torch.Tensor]] = {}
        offset = 0
        width = [len(r) if all_logits else 1 for r in rows]
        argmax = StepArgmax(logits)  # greedy rows without a grammar: one host read for the whole step
        for chunk, w in zip(plan.prefills, width):
            if chunk.seq.params.prompt_logprobs is not None:
                self._score_prompt_chunk(chunk, logits[offset : offset + w])
            if chunk.last:
                row = logits[offset + w - 1 : offset + w]
                constraint = chunk.seq.matcher
                banned = chunk.seq.params.bans_stops(0)
                if constraint is None and chunk.seq.params.greedy and not banned:
                    token = argmax.rows(offset + w - 1, offset + w)[0]
                else:
                    sampled = constraint.mask(row) if constraint is not None else row
                    sampled = self._ban_stops(chunk.seq, sampled) if banned else sampled
                    token = sample_token(sampled[0], chunk.seq.params, chunk.seq.generator, len(chunk.seq.output))
                if constraint is not None:
                    constraint.commit([token])
                out[chunk.seq] = ([token], row)
            offset += w
        decode_rows = rows[len(plan.prefills) :]
        for seq, w, fed in zip(plan.decodes, width[len(plan.prefills) :], decode_rows):
            seq_rows = logits[offset : offset + w]
            constraint = seq.matcher
            banned = seq.params.bans_stops(len(seq.output))
            if constraint is None and not banned:
                tokens = self.decoder.accept(
                    seq, seq_rows, argmax.rows(offset, offset + w) if seq.params.greedy else None
                )
            else:  # row i scores the token after fed[:i + 1]; fed[1:] are the drafts (none in plain decoding)
                masked = constraint.mask(seq_rows, fed[1:]) if constraint is not None else seq_rows
                tokens = self.decoder.accept(seq, self._ban_stops(seq, masked) if banned else masked)
                if constraint is not None:
                    constraint.commit(tokens)
            out[seq] = (tokens, seq_rows[: len(tokens)])
            offset += w
        return out

    def _ban_stops(self, seq: Sequence, rows: torch.Tensor) -> torch.Tensor:
        """`rows` (row i scores output token len(output) + i) with EOS and the stop token ids at -inf in every row
        that min_tokens still holds open; a copy, so the logprobs reported stay the model's own."""
        params, done = seq.params, len(seq.output)
        banned = [t for t in (*params.stop_token_ids, self.eos_token_id) if t is not None and 0 <= t < rows.shape[-1]]
        held = sum(1 for i in range(rows.shape[0]) if params.bans_stops(done + i))
        if not banned or not held:
            return rows
        rows = rows.clone()
        rows[:held, banned] = float("-inf")
        return rows

    def _score_prompt_chunk(self, chunk: PrefillChunk, rows: torch.Tensor) -> None:
        """Each prompt token's logprob (and the top k) from the rows of this prompt chunk: row j of a chunk starting
        at prompt position s scores prompt[s + j + 1]; the prompt's last row scores the first generated token and is
        left to the output path. The first prompt token has no logprob (None)."""
        seq = chunk.seq
        start = seq.num_prefilled - len(chunk.tokens)
        targets = seq.prompt[start + 1 : start + 1 + len(chunk.tokens)]
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None] if start == 0 else []
        scored = seq.prompt_logprobs
        if not targets:
            return
        rows = rows[: len(targets)]
        ids = torch.tensor(targets, device=rows.device)
        pairs = token_logprobs(rows, ids, seq.params.prompt_logprobs)
        logp = torch.log_softmax(rows.float(), dim=-1)
        ranks = (logp > logp.gather(-1, ids.view(-1, 1))).sum(-1).add(1).tolist()  # vLLM's rank: 1 = the argmax
        scored.extend({"id": t, "logprob": lp, "rank": r, "top": top} for t, (lp, top), r in zip(targets, pairs, ranks))

    # -- output processing -----------------------------------------
    def _emit(self, seq: Sequence, tokens: list[int], logit_rows: torch.Tensor | None) -> None:
        params = seq.params
        taken: list[int] = []
        reason: str | None = None
        stop_hit = False
        for tok in tokens:
            held_open = params.bans_stops(len(seq.output))  # min_tokens: no stop of any kind yet
            seq.output.append(tok)
            taken.append(tok)
            stops_at_eos = not params.ignore_eos or params.grammar is not None  # a grammar ends at the stop token
            if not held_open and (tok in params.stop_token_ids or (tok == self.eos_token_id and stops_at_eos)):
                reason, seq.matched_stop = "stop", tok
                if params.include_stop_str_in_output:
                    seq.text += seq.detokenizer.push([tok])
                break
            seq.text += seq.detokenizer.push([tok])
            if held_open:
                seq.stop_from = len(seq.text)  # stop strings match only in text after the first min_tokens
            elif params.stop and self._find_stop(seq):
                reason, stop_hit = "stop", True
                break
            if len(seq.output) >= params.max_tokens or len(seq.prompt) + len(seq.output) >= self._max_len():
                reason = "length"
                break
        if reason is not None and not stop_hit:
            seq.text += seq.detokenizer.flush()
        end = len(seq.text) if reason is not None else len(seq.text) - _stop_holdback(seq.text, params.stop)
        delta = seq.text[seq.sent : max(end, seq.sent)]
        seq.sent = max(end, seq.sent)
        lps = None
        if params.logprobs is not None:
            pairs = token_logprobs(
                logit_rows[: len(taken)], torch.tensor(taken, device=logit_rows.device), params.logprobs
            )
            lps = [{"id": t, "logprob": lp, "top": top} for t, (lp, top) in zip(taken, pairs)]
        self.stats["generated_tokens"] += len(taken)
        if reason is not None:
            self._finish(seq, reason, notify=False)
        self._send(
            seq,
            SeqEvent(
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
            ),
        )
        seq.prompt_logprobs = None

    def _find_stop(self, seq: Sequence) -> bool:
        """Search the new text for a stop string; on a match cut the text before it and record the match."""
        text = seq.text
        longest = max(len(s) for s in seq.params.stop)
        start = max(seq.stop_from, seq.checked - longest + 1)
        best = None
        for s in seq.params.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        seq.checked = len(text)
        if best is None:
            return False
        seq.text = text[: best[0] + (len(best[1]) if seq.params.include_stop_str_in_output else 0)]
        seq.matched_stop = best[1]
        return True

    def _finish(self, seq: Sequence, reason: str, *, notify: bool = True, error: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        if notify:
            self._send(
                seq,
                SeqEvent(
                    index=seq.index,
                    token_ids=[],
                    text="",
                    logprobs=None,
                    completion_tokens=len(seq.output),
                    finish_reason=reason,
                    spec=self.decoder.stats(seq),
                    error=error,
                    cached_tokens=seq.cached_tokens,
                ),
            )

    def _send(self, seq: Sequence, event: SeqEvent) -> None:
        """Hand `event` to the sequence's listener. With a stream interval N > 1, events after the one with the
        first token are held and merged until they carry N tokens or end the sequence (SGLang's --stream-interval):
        N times fewer events for the server process and its clients to stream, the same tokens and text."""
        if seq.on_event is None:
            return
        held, seq.held = seq.held, None
        if held is not None:
            event = held.then(event)
        if (
            self.stream_interval > 1
            and event.finish_reason is None
            and event.error is None
            and len(event.token_ids) < self.stream_interval
            and len(seq.output) > len(event.token_ids)
        ):
            seq.held = event
            return
        try:
            seq.on_event(event)
        except Exception:  # a failing listener must not kill the engine loop
            log.warning("dropping event for sequence %s:\n%s", seq.id, traceback.format_exc())

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


def _stop_holdback(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string (held back from streams)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


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
