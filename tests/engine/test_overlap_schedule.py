"""The engine's overlap schedule (engine/engine.py, GraphRunner.decode_async): greedy decode steps queued one ahead,
each fed the previous step's tokens on the device, their tokens read one step late.

On the CPU the static step runs un-captured (the dry path), so these tests check the schedule's logic: the same
engine with the overlap on and off gives the same tokens, text, finish reasons and events for requests that stop
by max_tokens, by max_seq_len, by a stop token and by a stop string, that arrive while others decode, that are
aborted mid-flight, and beside requests the overlap cannot serve (sampled, logprobs), and that the overlapped
steps really chained on the device. Rows fed from the device are recorded in the runner as the real tokens
(the prefix cache then hits pages that decode rows filled)."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.engine import Engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.static.graphs import GraphRunner
from evalpipe.engine.tokenizer import load_tokenizer

MAX_SEQ_LEN = 160


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


DEVICES = pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)


def make_engine(tiny_runner, tokenizer, overlap: bool, device: str = "cpu", **runner_kwargs) -> Engine:
    """On CUDA: float32, captured graphs, the fused kernels and the server's sites, as `evalpipe serve` builds."""
    from evalpipe.engine.model.fused_sites import SiteSettings

    cuda = device == "cuda"
    base = tiny_runner(
        max_seqs=6, max_seq_len=MAX_SEQ_LEN, device=device, sites=SiteSettings() if cuda else None, **runner_kwargs
    )
    graph = GraphRunner(base, widths=(1,), buckets=(1, 2, 4), fused=True, use_graphs=cuda)
    return Engine(graph, tokenizer, max_batch=4, max_tokens_per_step=64, overlap=overlap)


def collect(seq: Sequence, name: int, log: list) -> Sequence:
    seq.on_event = lambda ev: log.append((name, ev))
    return seq


def drive(engine: Engine, script: dict[int, list], aborts: dict[int, int], log: list, until=None) -> list[Sequence]:
    """Step the engine; at step k submit script[k]'s sequences and abort the sequence numbered aborts[k]. Until the
    engine is idle after the script, or as soon as `until(seqs)` holds."""
    seqs: list[Sequence] = []
    k = 0
    while (k <= max(script) or engine.busy) and not (until and until(seqs)):
        for seq in script.get(k, []):
            engine.submit([collect(seq, len(seqs), log)])
            seqs.append(seq)
        if k in aborts:
            engine.abort([seqs[aborts[k]]])
        engine.step()
        k += 1
        assert k < 2000, "the engine did not finish"
    return seqs


def workload(stop_token: int | None, stop_text: str | None) -> tuple[dict[int, list], dict[int, int]]:
    greedy = dict(temperature=0.0, ignore_eos=True)
    script = {
        0: [
            Sequence(prompt=prompt(37, 1), params=SamplingParams(max_tokens=30, **greedy)),
            Sequence(prompt=prompt(50, 2), params=SamplingParams(max_tokens=1, **greedy)),
            Sequence(prompt=prompt(29, 3), params=SamplingParams(max_tokens=2, **greedy)),
        ],
        # decodes to max_seq_len (160): 150 + 10 tokens, max_tokens is larger
        4: [Sequence(prompt=prompt(150, 4), params=SamplingParams(max_tokens=40, **greedy))],
        9: [
            Sequence(
                prompt=prompt(33, 5),
                params=SamplingParams(
                    max_tokens=40, stop_token_ids=(stop_token,) if stop_token is not None else (), **greedy
                ),
            )
        ],
        14: [
            Sequence(
                prompt=prompt(41, 6),
                params=SamplingParams(max_tokens=40, stop=(stop_text,) if stop_text else (), **greedy),
            ),
            Sequence(
                prompt=prompt(20, 7), params=SamplingParams(max_tokens=25, temperature=0.8, seed=11, ignore_eos=True)
            ),
        ],
        30: [
            Sequence(prompt=prompt(25, 8), params=SamplingParams(max_tokens=12, logprobs=2, **greedy)),
            Sequence(prompt=prompt(26, 9), params=SamplingParams(max_tokens=100, **greedy)),
        ],
    }
    return script, {20: 0, 75: 8}  # abort the first request mid-decode, and the last one


def outcome(seqs: list[Sequence], log: list) -> list:
    text: dict[int, str] = {}
    counts: dict[int, list[int]] = {}
    for name, ev in log:
        text[name] = text.get(name, "") + ev.text
        counts.setdefault(name, []).append(ev.completion_tokens)
    return [(s.output, s.finish_reason, s.matched_stop, text.get(i, ""), counts.get(i)) for i, s in enumerate(seqs)]


@DEVICES
def test_overlap_gives_the_same_outputs_and_events(tiny_runner, tokenizer, device):
    # the stop token and stop string are taken from what a plain run generates, so both really fire mid-sequence
    probe = make_engine(tiny_runner, tokenizer, overlap=False, device=device)
    log: list = []
    # stepped only until both have the tokens taken (what comes later in the script cannot change earlier steps)
    first = drive(probe, *workload(None, None), log, until=lambda s: len(s) > 5 and len(s[5].output) >= 10)
    stop_token = first[4].output[6]
    stop_text = tokenizer.decode(first[5].output[8:10])
    assert stop_text, "the probe's completion decodes to text"

    results, engines = {}, {}
    for overlap in (False, True):
        engine = make_engine(tiny_runner, tokenizer, overlap=overlap, device=device)
        log = []
        seqs = drive(engine, *workload(stop_token, stop_text), log)
        results[overlap], engines[overlap] = outcome(seqs, log), engine
        assert all(s.status is Status.FINISHED for s in seqs)
        assert engine.runner.runner.describe()["live_sequences"] == 1  # the pad slot
    for on, off in zip(results[True], results[False]):
        if off[1] == "abort":  # the token in flight when the abort arrives is dropped: at most one token fewer
            assert on[1] == "abort" and off[0][: len(on[0])] == on[0] and len(off[0]) - len(on[0]) in (0, 1)
        else:
            assert on == off
    reasons = [r[1] for r in results[True]]
    assert reasons == ["abort", "length", "length", "length", "stop", "stop", "length", "length", "abort"]
    assert len(results[True][3][0]) == MAX_SEQ_LEN - 150  # stopped by max_seq_len, not max_tokens
    assert results[True][4][2] == stop_token and results[True][5][2] == stop_text
    # the overlapped engine chained steps on the device; the other never queued one
    on, off = engines[True].runner.async_stats, engines[False].runner.async_stats
    assert off == {"steps": 0, "rows_fed_on_device": 0}
    assert on["steps"] > 30 and on["rows_fed_on_device"] > 30
    # the engine counts the steps it queued ahead (its log line's "overlapped"), the runner the ones it ran
    assert engines[True].stats["overlapped_steps"] == on["steps"] and engines[False].stats["overlapped_steps"] == 0
    for overlap, engine in engines.items():  # a row dropped after a stop or an abort is not counted as generated
        assert engine.stats["generated_tokens"] == sum(len(r[0]) for r in results[overlap])


@DEVICES
def test_rows_fed_on_the_device_are_recorded_as_their_tokens(tiny_runner, tokenizer, device):
    """With the prefix cache, a finished sequence's pages (decode rows included) are indexed by its tokens: a
    follow-up prompt = prompt + completion hits them, which it could not if a fed row were still a placeholder,
    and decodes what it decodes with the overlap off."""
    out = {}
    for overlap in (False, True):
        engine = make_engine(tiny_runner, tokenizer, overlap=overlap, device=device, prefix_cache=True, page_tokens=8)
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        a = Sequence(prompt=prompt(60, 21), params=params)
        engine.submit([a])
        while engine.busy:
            engine.step()
        follow = Sequence(prompt=a.prompt + a.output + [7, 8, 9], params=params)
        engine.submit([follow])
        while engine.busy:
            engine.step()
        out[overlap] = (a.output, follow.output, follow.cached_tokens)
        # 18 of each sequence's 20 tokens (the first comes from its prompt's step, the second from a host token)
        assert engine.runner.async_stats["rows_fed_on_device"] == (36 if overlap else 0)
    assert out[True] == out[False]
    assert out[True][2] >= 72  # 60 prompt + 19 fed completion tokens: 9 full pages of 8


def test_decode_async_refuses_a_token_nobody_chose(tiny_runner):
    graph = GraphRunner(tiny_runner(max_seqs=4, max_seq_len=64), widths=(1,), buckets=(1, 2), fused=True)
    seq = graph.allocate()
    graph.forward([seq], [prompt(10, 1)])
    with pytest.raises(ValueError, match="no token chosen"):
        graph.decode_async([seq], [None])
    with pytest.raises(ValueError, match="out of range"):
        graph.decode_async([seq], [10**6])
    pending = graph.decode_async([seq], [5])
    nxt = graph.decode_async([seq], [None])  # fed step 1's choice on the device
    assert graph.tokens(seq)[-1] == -1  # a placeholder until step 1 is settled
    first = graph.settle(pending)
    assert graph.tokens(seq)[-2:] == [5, first[0]]
    graph.free(seq)  # step 2's choice never reached the host: dropped, nothing indexed from a placeholder
    assert graph.settle(nxt) and graph.runner.describe()["live_sequences"] == 1  # the pad slot


@DEVICES
def test_a_sequence_ending_by_length_does_not_break_the_chain(tiny_runner, tokenizer, device):
    """Two sequences decode together; when the shorter one's last token (max_tokens) is in flight, it sits the next
    step out and the longer one's rows stay fed on the device: every token after each sequence's first two is fed
    from the device, and the tokens are those of the overlap off. With the prefix cache and 8-token pages, decode
    rows cross page edges every few steps (tails copied from the rings; on CUDA their indexes go through pinned
    memory behind the step in flight)."""
    out = {}
    for overlap in (False, True):
        engine = make_engine(tiny_runner, tokenizer, overlap=overlap, device=device, prefix_cache=True, page_tokens=8)
        seqs = [
            Sequence(
                prompt=prompt(30 + i, 40 + i), params=SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            )
            for i, n in enumerate((10, 30))
        ]
        engine.submit(seqs)
        while engine.busy:
            engine.step()
        out[overlap] = [s.output for s in seqs]
        if overlap:
            # the first token comes from the prompt's step, the second from a host-fed step; the rest are chained
            assert engine.runner.async_stats["rows_fed_on_device"] == (10 - 2) + (30 - 2)
    assert out[True] == out[False] and [len(o) for o in out[True]] == [10, 30]


class Ticks:
    """A clock that moves one unit per reading: the engine's prefill timing becomes a count of its readings."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def admitted_at(engine: Engine, late: Sequence, submit_at: int) -> int:
    """Step the engine until `late` (submitted before step `submit_at`) is admitted; the step index it was in."""
    k = 0
    while late.status is Status.WAITING:
        if k == submit_at:
            engine.submit([late])
        engine.step()
        k += 1
        assert k < 200
    while engine.busy:
        engine.step()
    return k - 1


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_delay_gathers_prompts_and_changes_no_token(tiny_runner, tokenizer, overlap):
    """With a delay factor, a prompt that arrives while another sequence decodes waits (the decoding steps go on,
    chained under the overlap) until F x the last prompt step's time has passed; a full chunk of waiting prompts or
    an idle engine admits at once. Tokens are those of factor 0."""
    greedy = dict(temperature=0.0, max_tokens=30, ignore_eos=True)
    out, steps = {}, {}
    for factor in (0.0, 20.0):
        base = tiny_runner(max_seqs=6, max_seq_len=MAX_SEQ_LEN)
        runner = GraphRunner(base, widths=(1,), buckets=(1, 2, 4), fused=True)
        engine = Engine(
            runner,
            tokenizer,
            max_batch=4,
            max_tokens_per_step=64,
            overlap=overlap,
            prefill_delay_factor=factor,
            clock=Ticks(),
        )
        first = Sequence(prompt=prompt(40, 61), params=SamplingParams(**greedy))
        late = Sequence(prompt=prompt(20, 62), params=SamplingParams(**greedy))
        engine.submit([first])
        steps[factor] = admitted_at(engine, late, submit_at=3)
        out[factor] = (first.output, late.output)
        # a full chunk (64 rows) of waiting prompts is admitted at once, however long the delay
        big = Sequence(prompt=prompt(70, 63), params=SamplingParams(**greedy))
        again = Sequence(prompt=prompt(40, 64), params=SamplingParams(**greedy))
        engine.submit([again])
        assert admitted_at(engine, big, submit_at=3) == 3
        # nothing decoding: admitted at once
        idle = Sequence(prompt=prompt(20, 65), params=SamplingParams(**greedy))
        assert admitted_at(engine, idle, submit_at=0) == 0
    assert out[20.0] == out[0.0]
    assert steps[0.0] == 3 and steps[20.0] > 6  # the first prompt step took 1 tick: 20 ticks of decode steps first
    with pytest.raises(ValueError):
        Engine(runner, tokenizer, prefill_delay_factor=-1)
