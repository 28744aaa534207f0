"""The engine's written contracts (engine/contracts.py) hold for the real parts: ModelRunner and GraphRunner offer the
`Runner` surface, the prefix cache is a capability object (None when off) that GraphRunner shares with the runner it
wraps, a drafter view shares weights but never state, and the runner's public row checks refuse what a forward
would refuse."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.contracts import Decoder, Runner
from evalpipe.engine.engine import PlainDecoder
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import NgramDrafter
from evalpipe.engine.static.graphs import GraphRunner

SMALL = {"max_seqs": 3, "max_seq_len": 128}


def runner_surface_missing(obj) -> list[str]:
    """Names of the Runner protocol's members `obj` lacks (the protocol's annotations and methods)."""
    names = set(Runner.__annotations__) | {
        n for n, v in vars(Runner).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    return sorted(n for n in names if not hasattr(obj, n))


def test_model_runner_and_graph_runner_offer_the_runner_surface(tiny_runner):
    plain = tiny_runner(**SMALL, prefix_cache=True)
    graph = GraphRunner(tiny_runner(**SMALL, prefix_cache=True), buckets=(1, 2), fused=False, use_graphs=False)
    assert runner_surface_missing(plain) == [] and runner_surface_missing(graph) == []
    assert runner_surface_missing(object()) != []  # the check itself can fail
    assert (plain.decodes_async, graph.decodes_async) == (False, True)
    assert plain.eager_runner is plain and graph.eager_runner is graph.runner
    assert graph.prefix_cache is graph.runner.prefix_cache is not None  # one cache, used through either
    assert tiny_runner(**SMALL).prefix_cache is None


def test_prefix_cache_capability_attaches_what_was_cached(tiny_runner):
    runner = tiny_runner(max_seqs=3, max_seq_len=256, prefix_cache=True, page_tokens=8)
    prompt = torch.randint(2, 500, (27,), generator=torch.Generator().manual_seed(3)).tolist()
    a = runner.allocate()
    runner.forward([a], [prompt])
    runner.prefix_cache.cache(a, len(prompt))
    b = runner.allocate()
    assert runner.prefix_cache.attach(b, prompt) == 24  # three full pages of 8, the last prompt row left to compute
    assert runner.tokens(b) == prompt[:24] and runner.prefix_cache.read_only_tokens(b) == 24
    assert runner.prefix_cache.attach(b, prompt) == 0  # only an empty sequence attaches
    runner.truncate(b, 10)  # below its shared pages: it recomputes privately and holds no read-only page
    assert runner.prefix_cache.read_only_tokens(b) == 0 and runner.seq_len(b) == 10
    assert runner.prefix_cache.flush()["flushed_pages"] >= 3


def test_a_view_shares_weights_and_never_state(tiny_runner):
    target = tiny_runner(**SMALL, prefix_cache=True)
    view = target.view(num_layers=2)
    assert view.model.embed is target.model.embed and view.model.layers == target.model.layers[:2]
    assert len(target.model.layers) > 2 and list(view.config.layer_types) == list(target.config.layer_types[:2])
    assert view.pools is not target.pools and view.prefix_cache is not target.prefix_cache
    t, v = target.allocate(), view.allocate()
    target.forward([t], [[5, 6, 7]])
    assert target.seq_len(t) == 3 and view.seq_len(v) == 0
    full = target.view()
    f = full.allocate()
    same = full.forward([f], [[5, 6, 7]])
    fresh = target.allocate()
    assert torch.equal(same, target.forward([fresh], [[5, 6, 7]]))  # the same model, its own slots


def test_check_rows_refuses_what_forward_refuses(tiny_runner):
    runner = tiny_runner(max_seqs=2, max_seq_len=8)
    seq = runner.allocate()
    vocab = runner.config.vocab_size
    assert runner.check_rows(seq, [1, 2, None]) == 0  # None: a token the device supplies
    with pytest.raises(ValueError, match="out of range"):
        runner.check_rows(seq, [vocab])
    with pytest.raises(ValueError, match="out of range"):
        runner.forward([seq], [[-1]])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        runner.check_rows(seq, [1] * 9)
    with pytest.raises(KeyError):
        runner.check_rows(seq + 1, [1])
    runner.append_tokens(seq, [3, -1])
    runner.set_token(seq, 1, 4)
    assert runner.tokens(seq) == [3, 4]


def test_decoders_say_what_the_engine_needs_to_know(tiny_runner):
    target = tiny_runner(**SMALL)
    plain, spec = (
        PlainDecoder(),
        SpeculativeDecoder(
            target, NgramDrafter(vocab_size=target.config.vocab_size), block_size=3, simulate_acc_len=2.0
        ),
    )
    assert isinstance(plain, Decoder) and isinstance(spec, Decoder)
    assert (plain.one_row_greedy, spec.one_row_greedy) == (True, False)
    assert plain.grammar_blocker() is None and "simulated" in spec.grammar_blocker()
    seq = Sequence(prompt=[1, 2, 3], params=SamplingParams(max_tokens=4, temperature=0.0))
    plain.prepare([seq])  # the default hooks do nothing
    plain.release(0)
    assert seq.spec is None and plain.propose(seq) == [3]
