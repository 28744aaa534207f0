"""The engine process's loop (engine/loop.py `EngineLoop`) over real ZeroMQ pipes, with the tiny model in a thread of
this process: a step that released no event (a prompt chunk, tokens held by the stream interval) sends no `Step`
unless the heartbeat is due, and the tokens, text and finish that reach the server are the same either way."""

from __future__ import annotations

import os
import random
import threading

import zmq

from evalpipe.engine import ipc
from evalpipe.engine.engine import Engine
from evalpipe.engine.loop import EngineLoop
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.tokenizer import load_tokenizer


def serve_one(tiny_runner, heartbeat_s: float, prompt: list[int], max_tokens: int, interval: int) -> list[ipc.Step]:
    """Submit one greedy request to a running EngineLoop; every Step message until its sequence finished."""
    engine = Engine(
        tiny_runner(max_seqs=2, max_seq_len=256),
        load_tokenizer(None),
        max_batch=2,
        max_tokens_per_step=8,  # the prompt is fed in several chunks, each a step with no event
        stream_interval=interval,
    )
    ctx = zmq.Context()
    name = f"inproc://loop-{os.getpid()}-{random.getrandbits(32)}"
    loop_recv, to_loop = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    loop_recv.bind(name + "-in")
    to_loop.connect(name + "-in")
    loop_send, from_loop = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    loop_send.bind(name + "-out")
    from_loop.connect(name + "-out")
    loop = EngineLoop(engine, loop_recv, loop_send, parent=os.getppid(), heartbeat_s=heartbeat_s)
    thread = threading.Thread(target=loop.run)
    thread.start()
    steps: list[ipc.Step] = []
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        to_loop.send_pyobj(ipc.Submit(call_id=1, rid=7, prompts=[prompt], params=[params], n=1))
        while True:
            assert from_loop.poll(60_000), "the loop sent nothing for 60 s"
            msg = from_loop.recv_pyobj()
            if isinstance(msg, ipc.Reply):
                assert msg.error is None
                continue
            assert isinstance(msg, ipc.Step)
            steps.append(msg)
            if any(ev.finish_reason is not None for _, ev in msg.events):
                return steps
    finally:
        to_loop.send_pyobj(ipc.Shutdown())
        thread.join(60)
        assert not thread.is_alive()
        for sock in (loop_recv, to_loop, loop_send, from_loop):
            sock.close(linger=0)
        ctx.term()


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
