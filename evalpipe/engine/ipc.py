"""The messages between the HTTP server process and the engine process (sent pickled over two ZeroMQ PUSH/PULL pipes).

Server -> engine: `Submit` (one request's sequences, all or none), `Abort` (a request whose client left; applied before
the next forward), `Call` (anything else that needs an answer: grammar compile, cache flush, describe), `Shutdown`.
Engine -> server: `Ready` (or `LoadFailed`) once, then one `Step` per engine step that produced events, carrying all of
them (all rows' new tokens in one message, never one message per token), an empty `Step` as a sign of life while steps
produce none (engine/loop.py, HEARTBEAT_S), a `Reply` per `Submit` and `Call`, and `Lost` when its device can run
nothing more, just before it exits. A request is identified by the
server's `rid`; the engine's `SeqEvent.index` is the choice within it. Everything here is plain data and torch-free: the
HTTP process unpickles it without importing the model's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter

from evalpipe.engine.sampling_params import SamplingParams


# -- server -> engine ----------------------------------------------------------------------------------
@dataclass
class Submit:
    call_id: int  # answered by a Reply: ok, or error "queue_full"
    rid: int
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt
    n: int  # choices per prompt (choice index = prompt_index * n + i)


@dataclass
class Abort:
    rids: list[int]


@dataclass
class Call:
    call_id: int
    method: str  # "compile" (args: a GrammarConstraint), "flush_cache", "describe"
    args: tuple = ()


@dataclass
class Shutdown:
    pass


# -- engine -> server ----------------------------------------------------------------------------------
@dataclass
class SeqEvent:
    """What one step did to one sequence: the tokens it committed and the text they released."""

    index: int  # choice index within the request
    token_ids: list[int]
    text: str  # new visible text (stop strings and partial UTF-8 held back)
    logprobs: list[dict] | None  # per committed token: {"id", "logprob", "top": [(id, logprob), ...]}
    completion_tokens: int  # cumulative generated tokens of this sequence
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None
    spec: dict | None = None  # speculation statistics (None while speculation is off)
    error: str | None = None
    cached_tokens: int = 0  # prompt tokens this sequence took from the prefix cache
    # on the sequence's first event when its params ask for prompt_logprobs: per prompt token, None (the first) or
    # {"id", "logprob", "rank", "top": [(id, logprob), ...]}
    prompt_logprobs: list[dict | None] | None = None

    def then(self, later: "SeqEvent") -> "SeqEvent":
        """This event followed by `later` of the same sequence, as one event (a reader that fell behind sends
        what both steps released in one chunk; per-token fields are concatenated, the rest is `later`'s)."""
        logprobs = (
            None if self.logprobs is None and later.logprobs is None else (self.logprobs or []) + (later.logprobs or [])
        )
        return SeqEvent(
            index=later.index,
            token_ids=self.token_ids + later.token_ids,
            text=self.text + later.text,
            logprobs=logprobs,
            completion_tokens=later.completion_tokens,
            finish_reason=later.finish_reason,
            matched_stop=later.matched_stop,
            spec=later.spec,
            error=later.error,
            cached_tokens=later.cached_tokens,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


@dataclass
class Ready:
    """What the server needs to validate requests and describe itself without asking the engine again."""

    pid: int
    model_id: str
    max_seq_len: int
    vocab_size: int
    bos_token_id: int | None
    max_queue: int
    grammar_blocker: str | None  # why constrained output is refused on this engine, or None
    static_info: dict  # the configuration parts of /get_server_info (config, runner, speculative, fused_sites)


@dataclass
class LoadFailed:
    error: str  # "ExceptionType: message", shown to the user


@dataclass
class Lost:
    error: str  # the device's own error; the engine process exits next (engine/device_loss.py)


@dataclass
class Step:
    """One engine step: (rid, SeqEvent) for every sequence it advanced or finished, in order."""

    events: list[tuple[int, SeqEvent]] = field(default_factory=list)

    def __reduce__(self):
        """Pickled as (rid, field values) rows, not as a dataclass per event (whose pickle names every field of
        every event): both processes pay this every engine step, for every sequence in it."""
        return _step_from_rows, ([(rid, _event_values(ev)) for rid, ev in self.events],)


_event_values = attrgetter(*(f.name for f in fields(SeqEvent)))


def _step_from_rows(rows: list[tuple[int, tuple]]) -> Step:
    return Step([(rid, SeqEvent(*values)) for rid, values in rows])


@dataclass
class Reply:
    call_id: int
    result: dict | bool | None = None  # describe/flush_cache: a dict; submit/compile: True
    error: str | None = None  # None: success
    error_kind: str | None = None  # "queue_full" | "grammar" | None (anything else)
