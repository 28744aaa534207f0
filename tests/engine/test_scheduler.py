"""Continuous-batching plans: row budget, prompt chunking, max batch, FIFO admission, bounded queue, freeing."""

import pytest

from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import QueueFull, Scheduler, Sequence, Status


class SlotPool:
    """A fixed number of runner slots (what ModelRunner.allocate/free manage), for planning without a model."""

    class Exhausted(RuntimeError):
        pass

    def __init__(self, n):
        self.free_slots = list(range(n))
        self.freed = []

    def allocate(self):
        if not self.free_slots:
            raise self.Exhausted()
        return self.free_slots.pop(0)

    def free(self, slot):
        self.freed.append(slot)
        self.free_slots.append(slot)


def seq(n_prompt):
    return Sequence(prompt=list(range(2, 2 + n_prompt)), params=SamplingParams())


def make(pool, **kw):
    return Scheduler(pool.allocate, pool.free, exhausted=(SlotPool.Exhausted,), **kw)


def test_long_prompt_is_chunked_to_the_row_budget():
    pool = SlotPool(4)
    s = make(pool, max_tokens_per_step=32)
    a = seq(80)
    s.add([a])
    sizes = []
    while a.prefilling:
        plan = s.schedule()
        sizes.append([len(c.tokens) for c in plan.prefills])
        assert plan.prefills[-1].last == (not a.prefilling)
    assert sizes == [[32], [32], [16]]
    assert s.schedule().decodes == [a]


def test_decode_rows_mix_with_prefill_chunks_in_one_step():
    pool = SlotPool(4)
    s = make(pool, max_tokens_per_step=20)
    a, b = seq(5), seq(40)
    s.add([a])
    s.schedule()  # a prefilled in one chunk
    a.output.append(7)
    s.add([b])
    plan = s.schedule()
    assert plan.decodes == [a]
    assert [(c.seq, len(c.tokens), c.last) for c in plan.prefills] == [(b, 19, False)]


def test_fifo_admission_and_max_batch():
    pool = SlotPool(8)
    s = make(pool, max_batch=2, max_tokens_per_step=100)
    seqs = [seq(3) for _ in range(4)]
    s.add(seqs)
    plan = s.schedule()
    assert [c.seq for c in plan.prefills] == seqs[:2]
    assert s.num_running == 2 and list(s.waiting) == seqs[2:]
    s.finish(seqs[0], "stop")
    plan = s.schedule()
    assert [c.seq for c in plan.prefills] == [seqs[2]]
    assert plan.decodes == [seqs[1]]


def test_admission_waits_when_runner_pool_is_exhausted():
    pool = SlotPool(1)
    s = make(pool, max_batch=8, max_tokens_per_step=100)
    a, b = seq(3), seq(3)
    s.add([a, b])
    s.schedule()
    assert a.status is Status.RUNNING and b.status is Status.WAITING
    s.finish(a, "length")
    assert pool.freed == [0]
    s.schedule()
    assert b.status is Status.RUNNING and b.slot == 0


def test_full_decode_batch_still_gives_prompts_some_rows():
    pool = SlotPool(64)
    s = make(pool, max_batch=64, max_tokens_per_step=8)
    running = [seq(1) for _ in range(8)]
    s.add(running)
    s.schedule()
    for r in running:
        r.output.append(5)
    late = seq(100)
    s.add([late])
    plan = s.schedule()
    assert len(plan.decodes) == 8
    assert [len(c.tokens) for c in plan.prefills] == [8]  # min(MIN_PREFILL_ROWS, budget) rows despite 8 decodes


def test_decode_width_counts_against_budget():
    pool = SlotPool(8)
    s = make(pool, max_tokens_per_step=30, decode_width=6)
    a = seq(2)
    s.add([a])
    s.schedule()
    a.output.append(3)
    b = seq(100)
    s.add([b])
    plan = s.schedule()
    assert [len(c.tokens) for c in plan.prefills] == [24]


def test_bounded_queue_rejects_whole_request():
    pool = SlotPool(1)
    s = make(pool, max_queue=3)
    s.add([seq(2), seq(2)])
    with pytest.raises(QueueFull):
        s.add([seq(2), seq(2)])
    assert s.num_waiting == 2


def test_abort_frees_slot_at_once():
    pool = SlotPool(2)
    s = make(pool)
    a, b = seq(4), seq(4)
    s.add([a, b])
    s.schedule()
    s.abort(a)
    assert a.status is Status.FINISHED and a.finish_reason == "abort" and a.slot is None
    assert pool.freed == [0] and s.running == [b]
    waiting = seq(2)
    s.add([waiting])
    s.abort(waiting)  # aborting a waiting sequence needs no slot
    assert s.num_waiting == 0 and pool.freed == [0]


def test_engine_tokens_do_not_depend_on_chunking_or_batch_mix():
    """The real engine on the tiny model: small prompt chunks mixed with decode rows give the same greedy tokens
    as whole-prompt prefill, and every runner slot is given back."""
    from evalpipe.engine.engine import Engine
    from evalpipe.engine.runner import ModelRunner, PoolExhausted
    from evalpipe.engine.scheduler import make_sequences
    from evalpipe.engine.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    runner = ModelRunner("evalpipe-tiny-dsv4", max_seqs=3, max_seq_len=160)
    prompts = [tok.encode_prompt("x" * n + "the quick brown fox") for n in (5, 41, 77, 100)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def run(step_rows, max_batch):
        engine = Engine(runner, tok, max_batch=max_batch, max_tokens_per_step=step_rows, exhausted=(PoolExhausted,))
        out = {i: [] for i in range(len(prompts))}
        for i, p in enumerate(prompts):
            engine.submit(make_sequences(p, params, 1, lambda ev, i=i: out[i].extend(ev.token_ids)))
        steps = 0
        while engine.step():
            steps += 1
        assert engine.allocated_slots == 0 and runner.describe()["live_sequences"] == 0
        return out, steps

    whole, whole_steps = run(512, 3)
    chunked, chunked_steps = run(24, 2)  # 24-row steps: prompts in chunks, interleaved with other decodes
    assert chunked_steps > whole_steps
    assert all(len(v) == 6 for v in whole.values())
    assert chunked == whole


def test_schedule_without_admission_leaves_the_queue_but_feeds_admitted_prompts():
    """`admit=False` (the engine's prefill delay): decode rows and the next chunk of an admitted prompt are planned,
    nothing is taken from the waiting queue; the next admitting step takes it."""
    pool = SlotPool(4)
    s = make(pool, max_tokens_per_step=16)
    a, b, c = seq(4), seq(40), seq(6)
    s.add([a, b])
    s.schedule()  # a whole, b's first 12 rows
    a.output.append(7)
    s.add([c])
    plan = s.schedule(admit=False)
    assert plan.decodes == [a] and [p.seq for p in plan.prefills] == [b] and len(plan.prefills[0].tokens) == 16
    assert list(s.waiting) == [c] and c.status is Status.WAITING
    plan = s.schedule(admit=True)
    assert [p.seq for p in plan.prefills] == [b, c] and c.status is Status.RUNNING
