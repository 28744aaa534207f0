"""Drafters for block speculation: who proposes the G tokens the target verifies in one forward.

- `layerskip:N`: the target's own first N layers, its final norm and its head (no extra weights; random tiny
  weights still give natural, partial acceptance);
- `model:PATH`: a separate small checkpoint in the same format and with the same tokenizer;
- `ngram`: prompt lookup, no model: the tokens that followed the latest earlier occurrence of the current suffix;
- `self`: the target itself with its own state (greedy acceptance must be 100%: a sanity mode).

Model drafters keep their OWN per-sequence state (a sequence handle of a runner with its own pools, and its own
prefix cache when the target has one: a new sequence starts from the drafter's cached pages) and draft all
sequences of a step together: one batched forward per draft position. A drafter sees the committed history
(prompt + output) of each sequence; it feeds whatever it has not consumed yet (the whole prompt the first time, then
the last one or two committed tokens), and after verification it is rolled back to the accepted prefix.

A drafter (the `Drafter` protocol) has a `name` and these methods, which the speculative decoder (spec/decoder.py)
calls:
- `propose(seqs, widths)` -> (drafts, qs): widths[i] drafts for seqs[i] and the [widths[i], V] distributions they
  were drawn from (q, for rejection sampling), or None under greedy, where acceptance only compares tokens;
- `rollback(seq, committed_before, accepted)`: after verify, keep the state of the first committed_before +
  accepted tokens (the bonus is not fed);
- `release(slot)`: the sequence in target slot `slot` is gone, free its draft state.
A new drafter kind is one class here and one case in `parse_drafter_spec` (spec/settings.py) / `build_drafter`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from evalpipe.engine.contracts import Runner
from evalpipe.engine.keyed import KeyedNoise
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling import keyed_sample_rows, sample, sampling_probs
from evalpipe.engine.scheduler import Sequence
from evalpipe.engine.spec.settings import parse_drafter_spec


class Drafter(Protocol):
    name: str

    def propose(self, seqs: list[Sequence], widths: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]: ...

    def rollback(self, seq: Sequence, committed_before: int, accepted: int) -> None: ...

    def release(self, slot: int) -> None: ...

    def describe(self) -> dict: ...


def history(seq: Sequence) -> list[int]:
    """Committed tokens of a sequence: prompt + output (the last one is not yet fed to the target)."""
    return seq.prompt + seq.output


class RunnerDrafter:
    """A drafter that is a runner (ModelRunner interface): a separate model, the target itself, or a layer prefix.

    `forward_kwargs` are passed to every `runner.forward` (layerskip passes `num_layers=N`).
    """

    catch_up_chunk = 512  # most rows a drafter forward takes while catching up with the committed history

    def __init__(self, name: str, runner: Runner, forward_kwargs: dict | None = None):
        self.name = name
        self.runner = runner
        self.forward_kwargs = dict(forward_kwargs or {})
        self._handles: dict[int, int] = {}  # target slot -> draft runner sequence

    def _handle(self, seq: Sequence) -> int:
        key = seq.slot
        if key not in self._handles:
            handle = self._handles[key] = self.runner.allocate()
            if self.runner.prefix_cache is not None:  # the drafter's own prefix cache, when it has one
                self.runner.prefix_cache.attach(handle, history(seq))
        return self._handles[key]

    def propose(self, seqs: list[Sequence], widths: list[int]):
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = [i for i, w in enumerate(widths) if w > 0]
        handles = {i: self._handle(seqs[i]) for i in active}
        feed = {}
        cache = self.runner.prefix_cache
        for i in active:
            hist = history(seqs[i])
            fed = self.runner.seq_len(handles[i])
            if cache is not None:  # between steps the drafter holds committed tokens only: final, shareable
                cache.cache(handles[i], fed)
            feed[i] = hist[fed:]  # never empty: the last committed token is never fed before drafting
            while len(feed[i]) > self.catch_up_chunk:  # a long prompt is fed in chunks, like a prefill
                self.runner.forward([handles[i]], [feed[i][: self.catch_up_chunk]], **self.forward_kwargs)
                feed[i] = feed[i][self.catch_up_chunk :]
        while active:
            logits = self.runner.forward([handles[i] for i in active], [feed[i] for i in active], **self.forward_kwargs)
            argmax = logits.argmax(-1).tolist()  # greedy rows need nothing else (one op for the whole batch)
            # under keyed sampling the draft for output token k draws with the target's key at k, so a drafter
            # whose q is close to p proposes the target's own sample (coupled noise); sample-verify reads no q
            keyed_rows = [
                (row, seqs[i].params, seqs[i].generator, len(seqs[i].output) + len(drafts[i]))
                for row, i in enumerate(active)
                if isinstance(seqs[i].generator, KeyedNoise)
            ]
            keyed = dict(zip((r[0] for r in keyed_rows), keyed_sample_rows(logits, keyed_rows)))
            still = []
            for row, i in enumerate(active):
                seq = seqs[i]
                if seq.params.greedy:
                    token = argmax[row]
                elif row in keyed:
                    token = keyed[row]
                else:
                    probs = sampling_probs(logits[row], seq.params)
                    token = int(sample(probs, seq.generator, len(seq.output) + len(drafts[i])))
                    qs[i].append(probs)
                drafts[i].append(token)
                if len(drafts[i]) < widths[i]:
                    feed[i] = [token]
                    still.append(i)
            active = still
        q_out = [torch.stack(q) if q else None for q in qs]
        return drafts, q_out

    def rollback(self, seq: Sequence, committed_before: int, accepted: int) -> None:
        handle = self._handles.get(seq.slot)
        if handle is None:
            return
        keep = committed_before + accepted
        if self.runner.seq_len(handle) > keep:
            self.runner.truncate(handle, keep)

    def release(self, slot: int) -> None:
        handle = self._handles.pop(slot, None)
        if handle is not None:
            self.runner.free(handle)

    def describe(self) -> dict:
        return {"drafter": self.name}


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (up to max_ngram tokens) of the
    history and propose what followed it; keep extending on the proposal itself until G tokens are found. With no
    match, repeat the last token. Deterministic, so under sampling q is the one-hot of the proposal."""

    def __init__(self, max_ngram: int = 3, vocab_size: int | None = None):
        self.name = "ngram"
        self.max_ngram = max_ngram
        self.vocab_size = vocab_size

    def lookup(self, tokens: list[int], count: int) -> list[int]:
        out: list[int] = []
        work = np.asarray(tokens, dtype=np.int64)
        while len(out) < count:
            take = self._follow(work, count - len(out)) or [int(work[-1])]
            out += take
            work = np.concatenate([work, np.asarray(take, dtype=np.int64)])
        return out

    def _follow(self, tokens: np.ndarray, count: int) -> list[int]:
        """Up to `count` tokens after the latest earlier occurrence of the longest matching suffix (vectorised:
        histories of tens of thousands of tokens are scanned in C, not Python)."""
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            suffix = tokens[length - n :]
            starts = np.flatnonzero(tokens[: length - n] == suffix[0])  # earlier starts, suffix itself excluded
            for k in range(1, n):
                starts = starts[tokens[starts + k] == suffix[k]]
            if starts.size:
                begin = int(starts[-1]) + n
                return tokens[begin : begin + count].tolist()
        return []

    def propose(self, seqs: list[Sequence], widths: list[int]):
        drafts, qs = [], []
        for seq, w in zip(seqs, widths):
            d = self.lookup(history(seq), w) if w > 0 else []
            drafts.append(d)
            if seq.params.greedy or not d:
                qs.append(None)
            else:
                if self.vocab_size is None:
                    raise ValueError("ngram drafter needs vocab_size for sampled acceptance")
                qs.append(torch.nn.functional.one_hot(torch.tensor(d), self.vocab_size).to(torch.float32))
        return drafts, qs

    def rollback(self, seq: Sequence, committed_before: int, accepted: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def describe(self) -> dict:
        return {"drafter": self.name}


def build_drafter(spec: str, target: ModelRunner) -> Drafter:
    """A drafter for `target` (an eager ModelRunner) from its command-line spec."""
    kind, arg = parse_drafter_spec(spec)
    vocab = int(target.config.vocab_size)
    if kind == "ngram":
        return NgramDrafter(vocab_size=vocab)
    common = dict(
        device=target.device,
        dtype=target.dtype,
        max_seqs=target.max_seqs,
        max_seq_len=target.max_seq_len,
        prefix_cache=target.prefix_cache is not None,
    )
    if kind == "model":
        runner = ModelRunner(arg, **common)
        if int(runner.config.vocab_size) != vocab:
            raise ValueError(f"draft model {arg} has vocab {runner.config.vocab_size}, the target has {vocab}")
        return RunnerDrafter(spec, runner)
    if kind == "self":
        return RunnerDrafter(spec, target.eager_runner.view())
    layers = int(target.config.num_hidden_layers)
    if arg >= layers:
        raise ValueError(f"layerskip:{arg} needs fewer layers than the target's {layers}")
    return RunnerDrafter(spec, target.eager_runner.view(num_layers=arg))
