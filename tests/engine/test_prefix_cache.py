"""The prefix cache (engine/prefix_cache.py) in the engine loop, in process, on the random tiny model: greedy tokens
equal with the cache on, with it off and against transformers' full-sequence forward, for prompts sharing a prefix
that ends at a page edge +-1, a sliding-window edge +-1, a compression-ratio edge +-1 and mid-chunk; with block
speculation on and off; on the static (CUDA-graph) step's CPU dry path, whose pages get their tails from the rings;
and under eviction pressure with a pool smaller than the working set."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.engine import Engine
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.scheduler import Sequence, Status
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.static.graphs import GraphRunner
from evalpipe.engine.tokenizer import load_tokenizer
from tests.support.spec_helpers import compare_with_tie_rule  # noqa: E402

NEW_TOKENS = 8
CHUNK = 48  # prefill rows per step: page edges 64 and 128 fall inside chunks
WINDOW, CSA_RATIO, HCA_RATIO, PAGE = 24, 4, 2, 64  # tiny_config.json; PAGE is the default page size there


def shared_prefix_lengths() -> dict[str, int]:
    """Where each variant leaves the base prompt, relative to the cached boundary 128 (two pages of 64)."""
    edge = 2 * PAGE
    return {
        "page-1": edge - 1,
        "page": edge,
        "page+1": edge + 1,
        "window-1": edge + WINDOW - 1,
        "window": edge + WINDOW,
        "window+1": edge + WINDOW + 1,
        "csa-1": edge + CSA_RATIO - 1,
        "csa": edge + CSA_RATIO,
        "csa+1": edge + CSA_RATIO + 1,
        "hca+1": edge + HCA_RATIO + 1,
        "mid-chunk": 3 * CHUNK + CHUNK // 2,
    }


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(15)
    rand = lambda n: torch.randint(2, 500, (n,), generator=gen).tolist()  # noqa: E731
    base = rand(3 * PAGE + 10)
    out = {"base": base}
    for name, shared in shared_prefix_lengths().items():
        out[name] = base[:shared] + rand(20)
    out["prefix-of-base"] = base[: 3 * PAGE + 1]  # a full hit, capped so the last row is computed
    out["base-page-edge"] = base[: 3 * PAGE]  # ends at a page edge: the hit stops one page short
    return out


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def run(engine: Engine, prompts: list[list[int]], *, together: bool) -> list[Sequence]:
    """Greedy NEW_TOKENS for each prompt: one after another, or all queued at once (hits on pages other sequences
    are still prefilling)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seqs = [Sequence(prompt=list(p), params=params) for p in prompts]
    batches = [seqs] if together else [[s] for s in seqs]
    for batch in batches:
        engine.submit(batch)
        for _ in range(10_000):
            if all(s.status is Status.FINISHED for s in batch):
                break
            engine.step()
    assert all(s.finish_reason == "length" and len(s.output) == NEW_TOKENS for s in seqs)
    return seqs


def spec_decoder(runner):
    return SpeculativeDecoder(
        runner, build_drafter("layerskip:2", getattr(runner, "eager_runner", runner)), block_size=3
    )


def serve(
    tiny_runner, tokenizer, prompts, *, cache: bool, spec: bool, page_tokens=None, num_pages=None, max_batch=4
) -> tuple[list[Sequence], Engine]:
    """The base prompt alone, then every other prompt queued at once, through a fresh engine."""
    runner = tiny_runner(
        max_seqs=max_batch, max_seq_len=512, prefix_cache=cache, page_tokens=page_tokens, num_pages=num_pages
    )
    engine = Engine(
        runner,
        tokenizer,
        max_batch=max_batch,
        max_tokens_per_step=CHUNK,
        decoder=spec_decoder(runner) if spec else None,
    )
    names = list(prompts)
    first = run(engine, [prompts[names[0]]], together=False)
    rest = run(engine, [prompts[n] for n in names[1:]], together=True)
    return first + rest, engine


@pytest.fixture(scope="module")
def reference(tiny_runner, tokenizer, prompts):
    """Cache off, speculation off: the engine's plain greedy tokens."""
    seqs, _ = serve(tiny_runner, tokenizer, prompts, cache=False, spec=False)
    assert all(s.cached_tokens == 0 for s in seqs)
    return {name: s.output for name, s in zip(prompts, seqs)}


def expected_hit(name: str, prompt: list[int], page: int) -> int:
    """The cached boundary a variant must reach: the last page edge inside both the prefix it shares with the
    base and its own prompt minus one token."""
    shared = shared_prefix_lengths().get(name, len(prompt))
    return min(shared, len(prompt) - 1) // page * page


@pytest.mark.parametrize("spec", [False, True], ids=["spec-off", "spec-on"])
@pytest.mark.parametrize("page_tokens", [None, 8], ids=["page64", "page8"])
def test_cache_on_equals_cache_off_at_every_boundary(tiny_runner, tokenizer, prompts, reference, spec, page_tokens):
    seqs, engine = serve(tiny_runner, tokenizer, prompts, cache=True, spec=spec, page_tokens=page_tokens)
    runner = engine.runner
    page = runner.pools.page_tokens
    assert page == (page_tokens or PAGE)
    for name, seq in zip(prompts, seqs):
        assert seq.output == reference[name], (name, seq.cached_tokens)
        if name != "base":  # queued together: a variant may see fewer pages if its prefix was still being fed
            assert 0 < seq.cached_tokens <= expected_hit(name, seq.prompt, page), (name, seq.cached_tokens)
    # queued after the base finished: the variants admitted once the base's pages were indexed got the full hit
    assert sum(s.cached_tokens == expected_hit(n, s.prompt, page) for n, s in zip(prompts, seqs) if n != "base") >= 8
    info = runner.describe()["prefix_cache"]
    assert info["hits"] == len(prompts) - 1 and info["hit_tokens"] == sum(s.cached_tokens for s in seqs)
    if spec:  # the drafter (layerskip:2, its own pools) starts from its own cached pages too
        drafter = engine.decoder.drafter.runner.prefix_cache.describe()
        assert drafter["hits"] >= len(prompts) - 2 and drafter["hit_tokens"] > 0, drafter


ORACLE_PROMPTS = ("base", "prefix-of-base", "base-page-edge", "page", "window", "csa", "hca+1", "mid-chunk")


def test_reference_matches_transformers(tiny_runner, prompts, reference):
    """The tokens both arms produce are transformers' full-sequence greedy tokens (tie rule as test_engine_oracle),
    on 8 of the 14 prompts: the base, its two truncations and one variant per boundary kind (lengths 148 to 202;
    the oracle has no cache, so what a variant shares with the base does not matter to it)."""
    transformers = pytest.importorskip("transformers")
    path = tiny_runner(max_seqs=1, max_seq_len=64).model_path
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    report = []
    with torch.no_grad():
        for name in ORACLE_PROMPTS:
            seq, want, margins = list(prompts[name]), [], []
            for _ in range(NEW_TOKENS):
                logits = oracle(torch.tensor([seq])).logits[0, -1].double()
                top2 = torch.topk(logits, 2).values
                want.append(int(logits.argmax()))
                margins.append(float(top2[0] - top2[1]))
                seq.append(want[-1])
            report.append(compare_with_tie_rule(reference[name], want, margins, name))
    print("\n".join(report))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))],
)
def test_static_step_pages_are_cached_and_reused(tiny_runner, tokenizer, device):
    """Decode and verify rows on the static step (the CUDA-graph path; on the CPU its dry run) write no tails
    themselves; the pages they complete get them from the rings. A follow-up prompt = prompt + completion (a chat's
    next turn) hits pages filled by decode rows and decodes the same tokens as with the cache off. On CUDA: float32,
    captured graphs, the fused kernels and the server's sites (prompt chunks through the attention kernel)."""
    from evalpipe.engine.model.fused_sites import SiteSettings

    gen = torch.Generator().manual_seed(3)
    first = torch.randint(2, 500, (60,), generator=gen).tolist()
    out = {}
    cuda = device == "cuda"
    for cache in (False, True):
        base = tiny_runner(
            max_seqs=3,
            max_seq_len=512,
            prefix_cache=cache,
            page_tokens=8,
            device=device,
            sites=SiteSettings() if cuda else None,
        )
        runner = GraphRunner(base, widths=(1, 4), buckets=(1, 2), fused=cuda, use_graphs=cuda)
        engine = Engine(runner, tokenizer, max_batch=2, max_tokens_per_step=CHUNK, decoder=spec_decoder(runner))
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        a = Sequence(prompt=first, params=params)
        engine.submit([a])
        while a.status is not Status.FINISHED:
            engine.step()
        follow = Sequence(prompt=first + a.output + [7, 8, 9], params=params)
        engine.submit([follow])
        while follow.status is not Status.FINISHED:
            engine.step()
        out[cache] = (a.output, follow.output, follow.cached_tokens)
    assert out[True][:2] == out[False][:2]
    assert out[False][2] == 0 and out[True][2] >= 72  # 60 prompt + 19 fed completion tokens: 9 full pages


def test_eviction_under_pressure_loses_nothing_and_corrupts_no_shared_page(tiny_runner, tokenizer):
    """A pool of 40 pages of 8 tokens for 4 running sequences and 16 prompts in 4 families sharing prefixes: pages
    are evicted all along, every request completes with the cache-off tokens, and every page comes back."""
    gen = torch.Generator().manual_seed(7)
    families = [torch.randint(2, 500, (70,), generator=gen).tolist() for _ in range(4)]
    prompts = {
        f"f{i}-{j}": families[i][: 40 + 9 * j] + torch.randint(2, 500, (5,), generator=gen).tolist()
        for j in range(4)
        for i in range(4)
    }
    off, _ = serve(tiny_runner, tokenizer, prompts, cache=False, spec=False, page_tokens=8, num_pages=40)
    on, engine = serve(tiny_runner, tokenizer, prompts, cache=True, spec=False, page_tokens=8, num_pages=40)
    runner = engine.runner
    for name, a, b in zip(prompts, off, on):
        assert a.output == b.output, name
    info = runner.describe()
    assert info["prefix_cache"]["evicted_pages"] > 0 and sum(s.cached_tokens > 0 for s in on) >= 6
    pools = runner.pools
    assert info["live_sequences"] == 0 and all(r == 0 for r in pools.page_refs)
    assert len(pools.free_pages) + pools.cache.evictable == pools.num_pages  # nothing leaked


def test_truncating_into_shared_pages_recomputes_privately(tiny_runner):
    """A rollback below a shared boundary must not write the shared pages: it re-prefills into private pages, and
    the sequence that still shares them decodes as before."""
    runner = tiny_runner(max_seqs=3, max_seq_len=512, prefix_cache=True, page_tokens=8)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(2, 500, (41,), generator=gen).tolist()

    def greedy(seq, first_logits, n):
        out, logits = [], first_logits
        for _ in range(n):
            out.append(int(logits[0].argmax()))
            logits = runner.forward([seq], [[out[-1]]])
        return out

    a = runner.allocate()
    want = greedy(a, runner.forward([a], [prompt]), 6)
    runner.prefix_cache.cache(a, len(prompt))
    b = runner.allocate()
    assert runner.prefix_cache.attach(b, prompt) == 40
    shared = list(runner.pools.seq_pages[b][:5])
    assert shared == runner.pools.seq_pages[a][:5]
    runner.truncate(b, 20)  # below the shared boundary
    assert not set(runner.pools.seq_pages[b]) & set(shared)
    assert greedy(b, runner.forward([b], [prompt[20:]]), 6) == want
    runner.truncate(a, len(prompt))  # a still shares those pages: they are intact
    assert greedy(a, _refeed(runner, a, prompt), 6) == want


def _refeed(runner, seq, prompt):
    """Logits of the last prompt row again: roll back one token and feed it."""
    runner.truncate(seq, len(prompt) - 1)
    return runner.forward([seq], [prompt[-1:]])


def test_default_model_gsm8k_prompts_hit_the_five_shot_prefix(cache_dir, tokenizer, monkeypatch):
    """The trained default model on two GSM8K lane prompts (one five-shot prefix, 2,212 characters): with the cache
    the 2nd prompt reuses every full page of the prefix and decodes exactly what it decodes without it. The 1st
    prompt, a miss, runs with the cache only (a miss against the cache off is the boundary tests' "base")."""
    from evalpipe.engine.runner import ModelRunner
    from evalpipe.lanes import get_lane

    monkeypatch.setenv("EVALPIPE_CACHE_DIR", str(cache_dir))
    data = get_lane("gsm8k").load(None, allow_data_drift=False)
    prompts = [tokenizer.encode_prompt(item.prompt) for item in data.items[:2]]
    prefix = data.extra["prefix_chars"]
    outs = {}
    for cache in (False, True):
        runner = ModelRunner(None, max_seqs=2, max_seq_len=4096, prefix_cache=cache)
        engine = Engine(runner, tokenizer, max_batch=2, max_tokens_per_step=512)
        outs[cache] = run(engine, prompts if cache else prompts[1:], together=False)
    page = 64
    assert [s.output for s in outs[True][1:]] == [s.output for s in outs[False]]
    assert outs[True][0].cached_tokens == 0
    # byte tokens: BOS + the prefix's bytes; every full page inside it is reused
    assert all(s.cached_tokens >= (prefix + 1) // page * page for s in outs[True][1:]), [
        s.cached_tokens for s in outs[True]
    ]


def test_page_finished_by_an_eager_forward_after_static_steps_has_a_whole_tail(tiny_runner):
    """A page whose first tail positions came from static decode steps (which write only the rings) and whose edge
    is crossed by an eager mixed forward (a decode row beside a prompt chunk): its tail must still be complete,
    so a later hit on it decodes as without the cache."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(2, 500, (59,), generator=gen).tolist()
    other = torch.randint(2, 500, (30,), generator=gen).tolist()
    out = {}
    for cache in (False, True):
        g = GraphRunner(
            tiny_runner(max_seqs=3, max_seq_len=256, prefix_cache=cache, page_tokens=8),
            widths=(1,),
            buckets=(1, 2),
            fused=False,
            use_graphs=False,
        )
        a, b = g.allocate(), g.allocate()
        tokens = list(prompt)
        logits = g.forward([a], [prompt])  # eager prefill: 0..58
        for _ in range(3):  # static steps: positions 59, 60, 61
            tokens.append(int(logits[0].argmax()))
            logits = g.forward([a], [[tokens[-1]]])
        for chunk in (other[:10], other[10:20]):  # eager mixed forwards: positions 62, 63 (crossing edge 64)
            tokens.append(int(logits[0].argmax()))
            logits = g.forward([a, b], [[tokens[-1]], chunk])[:1]
        g.free(a)
        g.free(b)
        c = g.allocate()
        probe = tokens + [5, 6, 7]
        hit = g.prefix_cache.attach(c, probe) if g.prefix_cache is not None else 0
        logits = g.forward([c], [probe[hit:]])
        got = []
        for _ in range(8):
            got.append(int(logits[0].argmax()))
            logits = g.forward([c], [[got[-1]]])
        out[cache] = (hit, got)
    assert out[False][0] == 0 and out[True][0] == 64
    assert out[True][1] == out[False][1]
