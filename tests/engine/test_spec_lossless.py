"""Greedy block speculation is lossless: for every drafter and block sizes {1, 2, 5, 6, 9}, the tokens equal plain
one-row greedy decoding token for token, over several prompts and batch mixes, and plain decoding equals the
transformers oracle (full-sequence forward). Tie rule (as in the oracle test): a first difference is allowed only
where the reference's top-2 logit margin is below 1e-4, and it is reported.

The `self` drafter must accept every draft (accept length exactly G+1 per step)."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.model.config import load_config
from evalpipe.engine.model.weights import default_checkpoint, load_state_dict, save_checkpoint
from evalpipe.engine.runner import ModelRunner
from evalpipe.engine.spec.decoder import SpeculativeDecoder
from evalpipe.engine.spec.drafters import build_drafter
from tests.support.spec_helpers import compare_with_tie_rule, finish, plain_greedy, spec_generate

NEW_TOKENS = 12  # at G=9 still two verify steps per sequence: the prefill token + up to 10, then the rest
BLOCK_SIZES = (1, 2, 5, 6, 9)
DRAFTERS = ("layerskip:2", "model", "ngram", "self")
# prompt lengths below and across the sliding window (24) and many compression boundaries (ratios 2 and 4);
# the first prompt makes the tiny model repeat a token, so the n-gram drafter gets accepted drafts too
PROMPT_LENGTHS = (30, 5, 41, 64)
# batch mixes (indices into PROMPTS): all together, alone, and partial mixes of different lengths
MIXES = ((0, 1, 2, 3), (2,), (3, 0), (1, 3, 2), (0, 2))


@pytest.fixture(scope="module")
def target():
    return ModelRunner("evalpipe-tiny-dsv4", max_seqs=16, max_seq_len=256)


@pytest.fixture(scope="module")
def draft_model_path(tmp_path_factory):
    """A separate checkpoint for the model:PATH drafter: the target's first two layers saved as their own 2-layer
    model (same vocabulary; partial, natural acceptance, and loaded through the ordinary checkpoint path)."""
    source = default_checkpoint()
    config = load_config(source)
    keep = 2
    config.num_hidden_layers = keep
    config.layer_types = list(config.layer_types[:keep])
    config.mlp_layer_types = list(config.mlp_layer_types[:keep])
    state = {
        k: v
        for k, v in load_state_dict(source).items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < keep
    }
    out = tmp_path_factory.mktemp("draft") / "tiny-first-2-layers"
    return str(save_checkpoint(config, state, out))


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    out = [torch.randint(16, 272, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    out[3][40:] = out[3][10:34]  # a repeated span, so n-gram lookup finds matches
    return out


@pytest.fixture(scope="module")
def reference(target, prompts):
    return [plain_greedy(target, p, NEW_TOKENS) for p in prompts]


def _drafter(name, target, draft_model_path):
    return build_drafter(f"model:{draft_model_path}" if name == "model" else name, target)


def test_plain_decoding_equals_transformers_oracle(prompts, reference, capsys):
    transformers = pytest.importorskip("transformers")
    from test_engine_oracle import oracle_greedy

    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(default_checkpoint(), dtype=torch.float32).eval()
    lines = []
    for i, (prompt, (tokens, _)) in enumerate(zip(prompts, reference)):
        want, margins = oracle_greedy(oracle, prompt, NEW_TOKENS)
        lines.append(compare_with_tie_rule(tokens, want, margins, f"prompt {i} (len {len(prompt)}) vs oracle"))
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_speculation_is_lossless(target, draft_model_path, prompts, reference, drafter_name, capsys):
    drafter = _drafter(drafter_name, target, draft_model_path)
    lines = []
    for j, block in enumerate(BLOCK_SIZES):
        decoder = SpeculativeDecoder(target, drafter, block_size=block)
        for mix in (MIXES[0], MIXES[1 + j % (len(MIXES) - 1)]):
            seqs = spec_generate(target, decoder, [prompts[i] for i in mix], NEW_TOKENS)
            for i, s in zip(mix, seqs):
                tokens, margins = reference[i]
                lines.append(
                    compare_with_tie_rule(
                        s.output[:NEW_TOKENS], tokens, margins, f"{drafter_name} G={block} mix={mix} prompt {i}"
                    )
                )
                stats = decoder.stats(s)
                assert sum(stats["accept_histogram"]) == stats["verify_steps"]
                if drafter_name == "self":
                    assert stats["accept_histogram"][block] == stats["verify_steps"], (
                        f"self drafter G={block}: histogram {stats['accept_histogram']}"
                    )
            hist = [sum(h) for h in zip(*(decoder.stats(s)["accept_histogram"] for s in seqs))]
            lines.append(f"{drafter_name} G={block} mix={mix}: accepted-drafts histogram {hist}")
            finish(target, decoder, seqs)
    with capsys.disabled():
        print("\n" + "\n".join(line for line in lines if "equal" not in line))
