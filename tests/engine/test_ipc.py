"""The engine -> server `Step` message (engine/ipc.py) survives the pipe's pickling unchanged: every SeqEvent field,
whatever it holds, in order, with its request id; and it travels as plain rows, not as one pickled dataclass per
event."""

from __future__ import annotations

import pickle
import random
from dataclasses import fields

from evalpipe.engine.ipc import SeqEvent, Step


def random_text(rng: random.Random) -> str:
    alphabet = 'ab \n\u2028\x85é中🙂\ufffd"\\'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))


def random_value(name: str, rng: random.Random):
    """A value of the kind field `name` holds, None where the field may be None."""
    maybe_none = rng.random() < 0.3
    if name in ("index", "completion_tokens", "cached_tokens"):
        return rng.randint(0, 10**6)
    if name == "token_ids":
        return [rng.randint(0, 2**31) for _ in range(rng.randint(0, 5))]
    if name == "text":
        return random_text(rng)
    if name == "logprobs":
        lp = rng.choice([float("-inf"), -0.0, -rng.random() * 30])
        return None if maybe_none else [{"id": rng.randint(0, 99), "logprob": lp, "top": [(1, lp), (2, -1.5)]}]
    if name == "prompt_logprobs":
        return None if maybe_none else [None, {"id": 3, "logprob": -0.5, "rank": 1, "top": [(3, -0.5)]}]
    if name == "finish_reason":
        return rng.choice([None, "stop", "length", "abort", "error"])
    if name == "matched_stop":
        return rng.choice([None, rng.randint(0, 99), random_text(rng)])
    if name == "spec":
        return None if maybe_none else {"accept_length": rng.random() * 5, "drafts": rng.randint(0, 9), "x": None}
    if name == "error":
        return None if maybe_none else random_text(rng)
    raise AssertionError(f"SeqEvent has a field this test does not draw: {name}")


def random_step(rng: random.Random, events: int) -> Step:
    return Step(
        [
            (rng.randint(1, 10**9), SeqEvent(**{f.name: random_value(f.name, rng) for f in fields(SeqEvent)}))
            for _ in range(events)
        ]
    )


def test_a_step_round_trips_through_pickle_field_by_field():
    rng = random.Random()
    for events in (0, 1, 2, 64, 200):
        step = random_step(rng, events)
        back = pickle.loads(pickle.dumps(step, pickle.DEFAULT_PROTOCOL))
        assert type(back) is Step and len(back.events) == events
        for (rid, ev), (rid2, ev2) in zip(step.events, back.events):
            assert rid2 == rid and type(ev2) is SeqEvent
            for f in fields(SeqEvent):
                assert repr(getattr(ev2, f.name)) == repr(getattr(ev, f.name)), f.name  # repr: -inf, -0.0 and NaN too


def test_a_nan_logprob_and_a_lone_surrogate_cross_unchanged():
    ev = SeqEvent(
        index=0,
        token_ids=[1],
        text="\ud800x",
        logprobs=[{"id": 1, "logprob": float("nan"), "top": []}],
        completion_tokens=1,
    )
    back = pickle.loads(pickle.dumps(Step([(7, ev)])))
    ((rid, got),) = back.events
    assert rid == 7 and got.text == "\ud800x" and got.logprobs[0]["logprob"] != got.logprobs[0]["logprob"]


def test_a_step_travels_as_rows_not_as_pickled_dataclasses():
    step = random_step(random.Random(), 64)
    data = pickle.dumps(step, pickle.DEFAULT_PROTOCOL)
    assert b"SeqEvent" not in data  # the class is named once, by the function that rebuilds the events
    per_event = pickle.dumps([(rid, ev.__dict__) for rid, ev in step.events], pickle.DEFAULT_PROTOCOL)
    assert len(data) < len(per_event)  # no field name repeated per event
