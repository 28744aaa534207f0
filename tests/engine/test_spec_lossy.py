"""The lossy acceptance rules inside the speculative decoder on the real tiny model (no mocks): top-k accepts
drafts the exact rule rejects and every token it emits is among the target's top K; thresholds leave greedy
requests token-for-token equal to plain greedy decoding, and act on sampled ones; the server settings build the
rule and refuse impossible ones; every `spec` says which rule ran and whether it decided lossily."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.config import EngineConfig
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.sampling_params import SamplingParams
from evalpipe.engine.spec.decoder import SpeculativeDecoder, decoder_from_settings
from evalpipe.engine.spec.drafters import build_drafter
from evalpipe.engine.spec.settings import AcceptRule
from evalpipe.server.state import ServerSettings
from tests.support.spec_helpers import compare_with_tie_rule, finish, plain_greedy, spec_generate, start

NEW_TOKENS = 24
BLOCK = 5
K = 3


@pytest.fixture(scope="module")
def target():
    return ModelRunner(max_seqs=16, max_seq_len=256)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(16, 272, (n,), generator=gen).tolist() for n in (7, 30, 52)]


@pytest.fixture(scope="module")
def drafter(target):
    return build_drafter("layerskip:2", target)


def _ranks(target, prompt: list[int], output: list[int]) -> list[int]:
    """The target's rank (0 = argmax) of every output token given the prompt and the output before it."""
    seq = target.allocate()
    try:
        logits = target.forward([seq], [prompt + output[:-1]], all_logits=True)[len(prompt) - 1 :]
    finally:
        target.free(seq)
    own = logits.gather(1, torch.tensor(output).unsqueeze(1))
    return (logits > own).sum(dim=1).tolist()


def test_topk_accepts_more_than_exact_and_emits_only_top_k_tokens(target, drafter, prompts, capsys):
    exact = SpeculativeDecoder(target, drafter, block_size=BLOCK)
    lossy = SpeculativeDecoder(target, drafter, block_size=BLOCK, accept_rule=AcceptRule(topk=K))
    exact_seqs = spec_generate(target, exact, prompts, NEW_TOKENS)
    lossy_seqs = spec_generate(target, lossy, prompts, NEW_TOKENS)
    accepted = {
        name: sum(dec.stats(s)["accepted_drafts"] for s in seqs) / sum(dec.stats(s)["verify_steps"] for s in seqs)
        for name, dec, seqs in (("exact", exact, exact_seqs), ("topk", lossy, lossy_seqs))
    }
    ranks = [_ranks(target, p, s.output[:NEW_TOKENS]) for p, s in zip(prompts, lossy_seqs)]
    for s in lossy_seqs:
        spec = lossy.stats(s)
        assert spec["accept"] == {"rule": "topk", "k": K, "lossy": True, "applies_to": "greedy and sampled requests"}
        assert spec["lossy"] is True
    for s in exact_seqs:
        assert exact.stats(s)["accept"] == {"rule": "exact", "lossy": False} and exact.stats(s)["lossy"] is False
    with capsys.disabled():
        print(
            f"\naccepted drafts per step: exact {accepted['exact']:.2f}, topk k={K} {accepted['topk']:.2f}; "
            f"target ranks of the top-k output: {ranks}"
        )
    assert all(r < K for row in ranks for r in row), "top-k emitted a token outside the target's top K"
    assert any(r > 0 for row in ranks for r in row), "top-k never accepted a non-argmax draft: the rule did not act"
    assert accepted["topk"] > accepted["exact"]
    assert lossy.describe()["accept"]["rule"] == "topk"
    finish(target, exact, exact_seqs)
    finish(target, lossy, lossy_seqs)


def test_thresholds_leave_greedy_requests_exact(target, drafter, prompts):
    """SGLang verifies greedy requests exactly whatever its thresholds: so does the native engine."""
    decoder = SpeculativeDecoder(
        target, drafter, block_size=BLOCK, accept_rule=AcceptRule(threshold_single=0.05, threshold_acc=0.05)
    )
    seqs = spec_generate(target, decoder, prompts, NEW_TOKENS)
    for prompt, s in zip(prompts, seqs):
        tokens, margins = plain_greedy(target, prompt, NEW_TOKENS)
        compare_with_tie_rule(s.output[:NEW_TOKENS], tokens, margins, "greedy request on a threshold server")
        spec = decoder.stats(s)
        assert spec["accept"]["rule"] == "threshold" and spec["accept"]["lossy"] is True
        assert spec["lossy"] is False  # the rule did not decide this request
    finish(target, decoder, seqs)


def test_thresholds_act_on_sampled_requests(target, drafter, prompts):
    """threshold_single 0 accepts every draft (SGLang's extreme): every verify step keeps all G drafts, where the
    exact sampler with the same seeds keeps far fewer."""
    params = SamplingParams(temperature=1.0, max_tokens=1 << 20, seed=7)
    results = {}
    for name, rule in (("exact", AcceptRule()), ("threshold", AcceptRule(threshold_single=0.0))):
        decoder = SpeculativeDecoder(target, drafter, block_size=BLOCK, accept_rule=rule)
        seqs = start(target, prompts, params, seeds=[1, 2, 3])
        for _ in range(4):
            decoder.verify_step(seqs)
        results[name] = [decoder.stats(s) for s in seqs]
        finish(target, decoder, seqs)
    for spec in results["threshold"]:
        assert spec["accept_histogram"][BLOCK] == spec["verify_steps"] == 4
        assert spec["lossy"] is True and spec["accept"]["threshold_single"] == 0.0
    assert sum(s["accepted_drafts"] for s in results["exact"]) < sum(s["accepted_drafts"] for s in results["threshold"])
    assert all(s["lossy"] is False for s in results["exact"])


def test_server_settings_build_the_rule_and_default_is_exact(target):
    exact = decoder_from_settings(EngineConfig(speculative="block", drafter="layerskip:2"), target)
    assert exact.describe()["accept"] == {"rule": "exact", "lossy": False}
    lossless = decoder_from_settings(
        EngineConfig(
            speculative="block", drafter="layerskip:2", spec_accept_threshold_single=1.0, spec_accept_threshold_acc=1.0
        ),
        target,
    )
    assert lossless.accept_rule.name == "exact"  # thresholds of 1.0 are SGLang's lossless default
    topk = decoder_from_settings(EngineConfig(speculative="block", drafter="layerskip:2", spec_accept_topk=4), target)
    assert topk.describe()["accept"]["k"] == 4
    with pytest.raises(ValueError, match="nothing to decide"):
        decoder_from_settings(
            EngineConfig(speculative="block", drafter="layerskip:2", spec_accept_topk=2, simulate_acc_len=3.0), target
        )
    info_before_load = ServerSettings(EngineConfig(speculative="block", spec_accept_threshold_acc=0.5))
    import asyncio

    from evalpipe.server.state import ServerState

    info = asyncio.run(
        ServerState(info_before_load).info()
    )  # what /get_server_info says while the model is still loading
    assert info["speculative"]["accept"]["rule"] == "threshold" and info["speculative"]["accept"]["lossy"] is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["--spec-accept-topk", "3"], "needs --speculative block"),
        (["--speculative", "block", "--spec-accept-topk", "1"], "K >= 2"),
        (["--speculative", "block", "--spec-accept-topk", "3", "--spec-accept-threshold-single", "0.5"], "not both"),
        (["--speculative", "block", "--spec-accept-threshold-acc", "1.5"], "0.0<=x<=1.0"),
        (["--speculative", "block", "--spec-accept-topk", "2", "--simulate-acc-len", "3"], "nothing to decide"),
    ],
)
def test_serve_refuses_impossible_acceptance_flags(args, message):
    """Usage errors (exit 2) before anything loads, never a traceback."""
    from click.testing import CliRunner

    from evalpipe.commands.serve import command as serve

    result = CliRunner().invoke(serve, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert "Traceback" not in result.output
