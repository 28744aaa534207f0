"""A prompt token's CSA selection under `--deterministic` does not depend on how the prompt is chunked or batched.

The indexer's top-k (engine/model/fused_sites.csa_rows) ranks a query's visible entries among the E entries of its
group, and E follows the group (this chunk's end, the longest request beside it). With E <= index_topk every entry
is kept in index order; above, the kept ones come by score. So a query whose visible entries are all kept met them
in an order that depended on its chunk, and the attention kernel sums its entry slots in slot order. Deterministic
sites sort the picks by entry index: the same pool rows in the same slots in every chunking. The default mode keeps
the score order (checked here too, so the test sees the difference it guards).

And a prompt chunk takes the eager path whatever its length: the GraphRunner sends a forward's requests of a graph
width (1 = decode) to its static step, a different op chain, unless the engine marks them as prompt chunks."""

from __future__ import annotations

import copy

import pytest
import torch

from evalpipe.engine.build import site_settings
from evalpipe.engine.config import EngineConfig
from evalpipe.engine.forward_batch import ForwardBatch
from evalpipe.engine.loop import build_engine
from evalpipe.engine.model import fused_sites
from evalpipe.engine.model.compressor import index_order
from evalpipe.engine.model.config import CSA
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.static.graphs import GraphRunner
from evalpipe.engine.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(None, max_seqs=4, max_seq_len=1024, sites=SiteSettings(deterministic=True))


def csa_attention(runner: ModelRunner, deterministic: bool):
    layer = next(lay for lay in runner.model.layers if lay.attn.layer_type == CSA)
    attn = copy.copy(layer.attn)
    attn.site_settings = SiteSettings(deterministic=deterministic)
    return attn


def rows_of(runner, attn, seq: int, start: int, scores: torch.Tensor, others: list[tuple[int, int]] = ()):
    """csa_rows of `seq`'s rows start..start+len(scores) in one forward's batch (with `others`: (slot, length) requests
    of the same row count beside it, longer ones raise the group's E), padded with -1 to the full width."""
    n, width = scores.shape
    slots, starts = [seq] + [s for s, _ in others], [start] + [length - n for _, length in others]
    ids = torch.zeros(n * len(slots), dtype=torch.long)
    batch = ForwardBatch(runner.pools, slots, starts, [n] * len(slots), ids)
    group = batch.groups[0]
    E = max((s + n) // attn.ratio for s in starts)
    full = torch.full((len(slots), n, E), float("-inf"))
    full[0, :, : min(width, E)] = scores[:, :E]
    pos = group.pos.reshape(-1, 1)
    visible = torch.arange(E)[None] < (pos + 1) // attn.ratio
    full = full.reshape(-1, E).masked_fill(~visible, float("-inf"))
    rows = fused_sites.csa_rows(attn, full, group, batch, min(attn.indexer.topk, E))[:n]
    return torch.nn.functional.pad(rows, (0, attn.indexer.topk - rows.shape[1]), value=-1)


@pytest.mark.parametrize("ties", [False, True])
def test_csa_picks_are_the_same_whole_chunked_and_beside_a_longer_request(runner, ties):
    attn = csa_attention(runner, deterministic=True)
    ratio, topk = attn.ratio, attn.indexer.topk
    length = ratio * (topk + 6)  # the whole prompt has more entries than top-k: ranked by score
    seq, other = runner.allocate(), runner.allocate()
    try:
        runner.pools.reserve({seq: length, other: 2 * length})
        gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
        E = length // ratio
        scores = (
            torch.randint(0, 3, (length, E), generator=gen) if ties else torch.randn(length, E, generator=gen)
        ).float()
        whole = rows_of(runner, attn, seq, 0, scores)
        cut = ratio * (topk - 2) + 1  # the first chunk has fewer entries than top-k: every visible one kept
        first = rows_of(runner, attn, seq, 0, scores[:cut])
        second = rows_of(runner, attn, seq, cut, scores[cut:])
        assert torch.equal(torch.cat([first, second]), whole)
        beside = rows_of(runner, attn, seq, 0, scores[:cut], others=[(other, 2 * length)])  # E of the longer one
        assert torch.equal(beside, first)
        # the default mode's order differs where a query sees >= 2 entries: what the sort removes
        default = rows_of(runner, csa_attention(runner, deterministic=False), seq, 0, scores)
        assert torch.equal(index_order(default), whole)
        assert not torch.equal(default, whole) or ties
    finally:
        runner.free(seq)
        runner.free(other)


def test_index_order_sorts_picks_and_puts_none_last():
    picked = torch.tensor([[5, -1, 2, 9], [-1, -1, -1, -1], [3, 1, 0, 2]])
    assert index_order(picked).tolist() == [[2, 5, 9, -1], [-1, -1, -1, -1], [0, 1, 2, 3]]
    assert index_order(picked[:, :0]).shape == (3, 0)


def test_deterministic_graph_runner_keeps_prompt_chunks_of_a_graph_width_on_the_eager_path():
    """A prompt chunk of one row (a decode step's width: the rest after a prefix-cache hit, or of a chunking) beside
    a decode: with `prompt_chunks` the deterministic GraphRunner runs it eagerly, bitwise as a plain runner does,
    and the decode through the static step."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    prompts = [torch.randint(2, 256, (int(n),), generator=gen).tolist() for n in torch.randint(30, 90, (2,))]
    extra = torch.randint(2, 256, (2,), generator=gen).tolist()
    sites = SiteSettings(deterministic=True)
    graph = GraphRunner(ModelRunner(None, max_seqs=4, max_seq_len=256, sites=sites), widths=(1,), buckets=(1, 2))
    plain = ModelRunner(None, max_seqs=4, max_seq_len=256, sites=sites)
    a, b, c = graph.allocate(), graph.allocate(), plain.allocate()
    for seq, prompt in ((a, prompts[0]), (b, prompts[1])):  # one by one: the CPU's GEMMs vary with the row count
        graph.forward([seq], [prompt])
    plain.forward([c], prompts[:1])
    assert graph.graph_part([[1], [2], [3]], eager_first=1) == [1, 2]
    assert graph.graph_part([[1], [2, 3]], eager_first=1) == []
    mixed = graph.forward([a, b], [[extra[0]], [extra[1]]], prompt_chunks=1)
    alone = plain.forward([c], [[extra[0]]])
    assert torch.equal(mixed[0], alone[0])
    assert graph.tokens(a) == plain.tokens(c)


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_engine_marks_the_one_row_rest_after_a_cache_hit_as_a_prompt_chunk(deterministic):
    """The engine over a GraphRunner (the CUDA build; its static step runs eagerly on the CPU): a prompt of 129
    tokens after a 128-token cache hit is prefilled as a 1-row chunk, a decode step's width. With one new token no
    decode follows, so a static step is built only if the prompt chunk went there: never when deterministic (the
    engine passes `prompt_chunks`), as before in the default mode."""
    config = EngineConfig(deterministic=deterministic, prefix_cache="on", max_batch=2, max_seq_len=512)

    def build(c):
        runner = ModelRunner(None, max_seqs=3, max_seq_len=512, sites=site_settings(c), prefix_cache=True)
        return GraphRunner(runner, widths=(1,), buckets=(1, 2)), None

    eng = build_engine(config, build, lambda c: load_tokenizer(None))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 20, ())))
    prompt = torch.randint(2, 256, (129,), generator=gen).tolist()
    seqs = []
    for ids in (prompt[:-1] + [1, 2, 3], prompt):  # the first indexes two pages of 64 that the second shares
        seqs.append(Sequence(prompt=ids, params=SamplingParams(max_tokens=1, temperature=0.0)))
        eng.submit(seqs[-1:])
        while seqs[-1].status is not Status.FINISHED:
            eng.step()
    assert seqs[-1].cached_tokens == 128 and len(seqs[-1].output) == 1
    assert (eng.runner.steps == {}) == deterministic
