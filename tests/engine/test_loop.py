"""The engine process's loop (engine/loop.py `EngineLoop`) over real ZeroMQ pipes, with the tiny model in a thread of
this process: a step that released no event (a prompt chunk, tokens held by the stream interval) sends no `Step`
unless the heartbeat is due, and the tokens, text and finish that reach the server are the same either way."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time

import zmq

from evalpipe.engine import ipc
from evalpipe.engine.config import GATHER_CAP, LONE_SHARE
from evalpipe.engine.engine import Engine
from evalpipe.engine.loop import EngineLoop
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.tokenizer import load_tokenizer


@contextlib.contextmanager
def running_loop(engine: Engine, **loop_kwargs):
    """An EngineLoop over `engine` in a thread, behind real ZeroMQ pipes: yields (to the loop, from the loop)."""
    ctx = zmq.Context()
    name = f"inproc://loop-{os.getpid()}-{random.getrandbits(32)}"
    loop_recv, to_loop = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    loop_recv.bind(name + "-in")
    to_loop.connect(name + "-in")
    loop_send, from_loop = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    loop_send.bind(name + "-out")
    from_loop.connect(name + "-out")
    loop = EngineLoop(engine, loop_recv, loop_send, parent=os.getppid(), **loop_kwargs)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        yield to_loop, from_loop
    finally:
        to_loop.send_pyobj(ipc.Shutdown())
        thread.join(60)
        assert not thread.is_alive()
        for sock in (loop_recv, to_loop, loop_send, from_loop):
            sock.close(linger=0)
        ctx.term()


def next_step(from_loop) -> ipc.Step:
    """The loop's next Step message (Replies to submits checked and skipped)."""
    while True:
        assert from_loop.poll(60_000), "the loop sent nothing for 60 s"
        msg = from_loop.recv_pyobj()
        if isinstance(msg, ipc.Reply):
            assert msg.error is None
            continue
        assert isinstance(msg, ipc.Step)
        return msg


def serve_one(tiny_runner, heartbeat_s: float, prompt: list[int], max_tokens: int, interval: int) -> list[ipc.Step]:
    """Submit one greedy request to a running EngineLoop; every Step message until its sequence finished."""
    engine = Engine(
        tiny_runner(max_seqs=2, max_seq_len=256),
        load_tokenizer(None),
        max_batch=2,
        max_tokens_per_step=8,  # the prompt is fed in several chunks, each a step with no event
        stream_interval=interval,
    )
    steps: list[ipc.Step] = []
    with running_loop(engine, heartbeat_s=heartbeat_s) as (to_loop, from_loop):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        to_loop.send_pyobj(ipc.Submit(call_id=1, rid=7, prompts=[prompt], params=[params], n=1))
        while True:
            steps.append(next_step(from_loop))
            if any(ev.finish_reason is not None for _, ev in steps[-1].events):
                return steps


def output(steps: list[ipc.Step]) -> tuple:
    events = [ev for step in steps for rid, ev in step.events if rid == 7]
    return [t for ev in events for t in ev.token_ids], "".join(ev.text for ev in events), events[-1].finish_reason


def test_steps_without_events_send_nothing_until_the_heartbeat_is_due(tiny_runner):
    prompt = [random.randrange(16, 250) for _ in range(40)]  # 5 chunks of 8 rows
    every = serve_one(tiny_runner, 0.0, prompt, max_tokens=13, interval=4)  # a heartbeat due at every step
    never = serve_one(tiny_runner, float("inf"), prompt, max_tokens=13, interval=4)
    assert output(every) == output(never)
    assert len(output(never)[0]) == 13 and output(never)[2] == "length"
    assert sum(1 for s in every if not s.events) >= 4 + 9  # prompt chunks before the last, and the held steps
    assert all(s.events for s in never)
    assert [len(ev.token_ids) for s in never for _, ev in s.events] == [1, 4, 4, 4]


def serve_burst(tiny_runner, burst_wait_ms: float, gaps_s: list[float], **loop_kwargs) -> tuple[dict, float]:
    """Submit len(gaps_s) + 1 greedy requests to an idle EngineLoop, gaps_s[i] apart; run them to the end. Returns
    the engine's counters and the time from the first submit to the first Step (the first token)."""
    n = len(gaps_s) + 1
    engine = Engine(tiny_runner(max_seqs=n, max_seq_len=64), load_tokenizer(None), max_batch=n, max_tokens_per_step=512)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    loop = running_loop(engine, heartbeat_s=float("inf"), burst_wait_ms=burst_wait_ms, **loop_kwargs)
    with loop as (to_loop, from_loop):
        t0 = time.monotonic()
        for rid in range(n):
            if rid:
                time.sleep(gaps_s[rid - 1])
            prompt = [random.randrange(16, 250) for _ in range(12)]
            to_loop.send_pyobj(ipc.Submit(call_id=rid, rid=rid, prompts=[prompt], params=[params], n=1))
        step = next_step(from_loop)
        first_s, finished = time.monotonic() - t0, 0
        while True:
            finished += sum(1 for _, ev in step.events if ev.finish_reason is not None)
            if finished == n:
                return dict(engine.stats), first_s
            step = next_step(from_loop)


def test_an_idle_engine_gathers_a_burst_into_one_prompt_step(tiny_runner):
    """--burst-wait-ms 300: three requests 20 ms apart (inside the 75 ms a lone request waits, and the 300 ms two
    do) reach an idle engine, and all three prompts go in its first step."""
    assert 300 / LONE_SHARE > 20 * 3  # the test's premise, with a margin for a slow sender
    stats, _ = serve_burst(tiny_runner, 300.0, [0.02, 0.02])
    assert stats["prefill_steps"] == 1 and stats["prompt_tokens"] == 36


def test_a_lone_request_waits_a_share_of_the_burst_wait(tiny_runner):
    """--burst-wait-ms 1000: a lone request waits 250 ms (MS / LONE_SHARE; a lower bound the monotonic clock
    guarantees) for a second one, then runs: one that comes 700 ms after it (inside the whole wait, past the lone
    one) gets a prompt step of its own. Only a 450 ms stall of the loop could put the two in one step."""
    assert 1000 / LONE_SHARE == 250
    stats, first_s = serve_burst(tiny_runner, 1000.0, [])
    assert stats["prefill_steps"] == 1 and first_s >= 0.25
    stats, _ = serve_burst(tiny_runner, 1000.0, [0.7])
    assert stats["prefill_steps"] == 2 and stats["prompt_tokens"] == 24


def test_the_gather_stops_at_its_cap_while_requests_keep_coming(tiny_runner):
    """--burst-wait-ms 50 (and a lone request's wait set to 50 too): requests every 25 ms for 575 ms never leave a
    50 ms gap, so only the cap (GATHER_CAP x 50 = 500 ms) starts the first step, and the later ones wait for a step
    of their own. (A stall that stretches a gap past 50 ms ends the gather early: the same count, never a false
    failure.)"""
    assert GATHER_CAP * 50 < 575  # the test's premise: the burst outlasts the cap
    stats, _ = serve_burst(tiny_runner, 50.0, [0.025] * 23, lone_wait_ms=50.0)
    assert stats["prompt_tokens"] == 24 * 12 and stats["prefill_steps"] >= 2
