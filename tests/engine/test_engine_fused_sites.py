"""The engine's fused-op sites (evalpipe/engine/model/fused_sites.py) on the CPU, where the kernels' references run.

- With `candidate_block_mask` (default budget: every block) and `indexer_postprocess` on every CSA layer's
  selection, greedy tokens still equal the transformers oracle (same tie rule as test_engine_oracle).
- The sites really run: the engine's own call counter moves, a budget >= the block count gives bitwise the same
  logits as the default, and a budget of one block changes the selection, hence the logits.
- `evalpipe serve --wo-quant mxfp8` through real HTTP: returns tokens and reports the setting and its site calls."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from test_engine_oracle import TIE_MARGIN, engine_greedy, make_checkpoint, oracle_greedy

from evalpipe.engine.model import fused_sites
from evalpipe.engine.model.fused_sites import SiteSettings
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from tests.server.test_spec_server import start_server
from tests.support.spec_helpers import compare_with_tie_rule, finish, spec_generate

transformers = pytest.importorskip("transformers")

CONFIG = "csa-only"  # two CSA layers (ratio 4, index_topk 3: top-k actively selects) and one HCA layer
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fused-sites"), CONFIG)


def prompt(length: int, seed: int = 7) -> list[int]:
    return torch.randint(16, 272, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    seq = runner.allocate()
    try:
        return runner.forward([seq], [ids], all_logits=True)
    finally:
        runner.free(seq)


def test_greedy_with_fused_sites_matches_oracle(checkpoint):
    # the serving defaults: every candidate block kept, no WO quantization
    runner = ModelRunner(checkpoint, max_seqs=2, max_seq_len=256, sites=SiteSettings())
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = prompt(45)
    before = fused_sites.site_counts()
    mine = engine_greedy(runner, ids, NEW_TOKENS)
    calls = {k: v - before.get(k, 0) for k, v in fused_sites.site_counts().items()}
    # one prefill + NEW_TOKENS decode forwards, each through both CSA layers
    csa_layers = sum(a.attn.indexer is not None for a in runner.model.layers)
    want_calls = (NEW_TOKENS + 1) * csa_layers
    assert calls.get("candidate_block_mask") == want_calls and calls.get("indexer_postprocess") == want_calls, calls
    assert "wo_a_mxfp8" not in calls
    ref, margins = oracle_greedy(oracle, ids, NEW_TOKENS)
    first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
    assert first is None or margins[first] < TIE_MARGIN, (first, mine, ref)


def test_block_speculation_through_the_sites_equals_oracle_greedy(checkpoint):
    """(G+1)-row verify forwards and rollback with the sites on: spec-on greedy tokens equal the oracle's."""
    runner = ModelRunner(checkpoint, max_seqs=4, max_seq_len=256, sites=SiteSettings())
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = [prompt(45), prompt(13, seed=8)]
    decoder = SpeculativeDecoder(runner, build_drafter("layerskip:1", runner), block_size=5)
    seqs = spec_generate(runner, decoder, prompts, 16)
    for s in seqs:  # each verify step commits 1 to G + 1 = 6 tokens
        steps = decoder.stats(s)["verify_steps"]
        assert len(s.output) / 6 <= steps <= len(s.output), (steps, len(s.output))
    for i, (p, s) in enumerate(zip(prompts, seqs)):
        compare_with_tie_rule(s.output[:16], *oracle_greedy(oracle, p, 16), f"prompt {i}")
    finish(runner, decoder, seqs)


def test_candidate_budget_is_wired_and_default_is_exact(checkpoint):
    def runner(**sites):
        return ModelRunner(checkpoint, max_seqs=2, max_seq_len=256, sites=SiteSettings(**sites))

    ids = prompt(101, seed=11)  # 25 entries per CSA layer: 7 blocks of 4
    default = prefill_logits(runner(), ids)
    assert torch.equal(prefill_logits(runner(candidate_blocks=10_000), ids), default), (
        "a budget covering every block must be the default"
    )
    narrowed = prefill_logits(runner(candidate_blocks=1, candidate_block_size=1), ids)
    # rows that see more than one entry now attend to a single (newest) entry instead of the top-3
    assert float((narrowed - default).abs().max()) > 1e-3
    # rows before the first completed window see no entry at all: unchanged
    assert torch.equal(narrowed[:4], default[:4])


def test_bare_runner_built_with_the_server_settings_equals_the_served_one(checkpoint):
    """The fused-site choice is made when the model is built: `build` (what `evalpipe serve` runs) and a bare
    ModelRunner given the same SiteSettings run the same CSA and WO paths, bitwise, and call the same sites; a bare
    runner without them runs the plain path (here visibly, since --wo-quant mxfp8 is lossy)."""
    from evalpipe.engine.build import build
    from evalpipe.engine.config import EngineConfig

    served, decoder = build(EngineConfig(model=checkpoint, max_batch=2, max_seq_len=256, wo_quant="mxfp8"))
    bare = ModelRunner(checkpoint, max_seqs=2, max_seq_len=256, sites=SiteSettings(wo_quant="mxfp8"))
    plain = ModelRunner(checkpoint, max_seqs=2, max_seq_len=256)
    assert decoder is None and type(served) is ModelRunner and served.fused_sites == bare.fused_sites
    assert bare.fused_sites["wo_quant_layers"] == len(bare.model.layers) and plain.fused_sites is None
    ids = prompt(45)
    logits, calls = [], []
    for runner in (served, bare, plain):
        before = fused_sites.site_counts()
        seq = runner.allocate()
        out = [runner.forward([seq], [ids], all_logits=True)]
        for _ in range(4):
            out.append(runner.forward([seq], [[int(out[-1][-1].argmax())]]))
        logits.append(torch.cat(out))
        calls.append({k: v - before.get(k, 0) for k, v in fused_sites.site_counts().items() if v > before.get(k, 0)})
    assert torch.equal(logits[0], logits[1]) and calls[0] == calls[1]
    assert set(calls[0]) == {"candidate_block_mask", "indexer_postprocess", "wo_a_mxfp8", "mxfp8_linear"}
    assert calls[2] == {} and float((logits[2] - logits[0]).abs().max()) > 1e-4


@pytest.fixture(scope="module")
def wo_server():
    srv = start_server("--wo-quant", "mxfp8", "--max-seq-len", "256", "--max-batch", "2")
    yield srv
    assert srv.stop() == 0, srv.output()


def test_serve_wo_quant_mxfp8_smoke(wo_server):
    client = openai.OpenAI(base_url=wo_server.base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="12 + 30 =", max_tokens=8, temperature=0)
    assert out.usage.completion_tokens == 8 and out.choices[0].text
    info = httpx.get(wo_server.base + "/get_server_info", timeout=30).json()
    assert info["wo_quant"] == "mxfp8" and info["server_args"]["wo_quant"] == "mxfp8"
    sites = info["fused_sites"]
    assert sites["wo_quant"] == "mxfp8" and sites["wo_quant_layers"] == len(info["config"]["layer_types"])
    calls = info["internal_states"]["fused_site_calls"]
    assert calls["wo_a_mxfp8"] > 0 and calls["mxfp8_linear"] == calls["wo_a_mxfp8"]


def test_serve_help_says_wo_quant_is_lossy():
    from click.testing import CliRunner

    from evalpipe.commands.serve import command

    text = CliRunner().invoke(command, ["--help"]).output
    assert "--wo-quant" in text and "LOSSY" in text
