"""The native engine against transformers' DeepseekV4ForCausalLM (float32, CPU).

Oracle = transformers' *full-sequence* forward recomputed at every step (its cached `generate` is not causal-exact,
see ../shared/docs/oracle-notes.md). Four random tiny configs cover sliding, CSA (ratio 4, overlapping
compressor + lightning indexer with active top-k), HCA at ratio 2 and at larger ratios, MoE and hash-MoE, YaRN and
plain compress RoPE. Prompts cross the sliding window and many compression boundaries.

Greedy tokens must match; where they differ, the oracle's top-2 logit margin at the first differing step must be
below TIE_MARGIN (a numerical tie, e.g. an exact indexer top-k tie broken differently) and is reported."""

from __future__ import annotations

import os

import pytest
import torch

from evalpipe.engine.model.config import load_config
from evalpipe.engine.model.weights import init_tiny_weights, save_checkpoint
from evalpipe.engine.runner import ModelRunner

transformers = pytest.importorskip("transformers")

PREFILL_LOGIT_BOUND = 1e-4  # max |engine - oracle| over every prefill row's logits (observed ~5e-6)
TIE_MARGIN = 1e-4
NEW_TOKENS = 32  # from 7 and 101 every decode crosses two boundaries of the largest ratio (16), from 7 every window
ORACLE_MODEL_ENV = "EVALPIPE_ORACLE_MODEL"  # the shipped-model test's checkpoint (default: the default model)

_BASE = dict(
    vocab_size=512,
    bos_token_id=0,
    eos_token_id=1,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=32,
    index_n_heads=8,
    index_head_dim=16,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    max_position_embeddings=4096,
)
S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

CONFIGS = {
    # the default model's schedule: every attention type, HCA ratio 2, YaRN compress rope
    "mixed-hca2": dict(
        seed=1,
        num_hidden_layers=4,
        layer_types=[S, C, H, C],
        sliding_window=16,
        index_topk=4,
        compress_rates={C: 4, H: 2},
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256},
    ),
    # larger HCA ratio, HCA first, plain compress rope, sigmoid router
    "hca8-csa": dict(
        seed=2,
        num_hidden_layers=3,
        layer_types=[H, C, S],
        sliding_window=12,
        index_topk=6,
        compress_rates={C: 4, H: 8},
        mlp_layer_types=["moe", "hash_moe", "moe"],
        scoring_func="sigmoid",
    ),
    # CSA-heavy with a small top-k and a short window
    "csa-only": dict(
        seed=3,
        num_hidden_layers=3,
        layer_types=[C, C, H],
        sliding_window=8,
        index_topk=3,
        compress_rates={C: 4, H: 16},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    ),
    # ratio-2 HCA everywhere but one sliding layer
    "hca2-sliding": dict(
        seed=4,
        num_hidden_layers=3,
        layer_types=[H, S, H],
        sliding_window=20,
        index_topk=4,
        compress_rates={C: 4, H: 2},
        mlp_layer_types=["moe", "moe", "hash_moe"],
    ),
}
# below / above every window (the longer one also gives every ratio several compressed blocks and every CSA layer
# more entries than its top-k); decodes cross more window and ratio boundaries
PROMPT_LENGTHS = (7, 101)


def make_checkpoint(tmp_dir, name: str) -> str:
    spec = dict(CONFIGS[name])
    seed = spec.pop("seed")
    config = load_config({**_BASE, **spec})
    out = tmp_dir / name
    save_checkpoint(config, init_tiny_weights(config, seed=seed), out)
    return str(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv4")
    return {name: make_checkpoint(root, name) for name in CONFIGS}


def oracle_greedy(model, prompt: list[int], steps: int):
    """Greedy tokens recomputed from the full sequence each step, with each step's top-2 margin."""
    seq, tokens, margins = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([seq])).logits[0, -1].double()
            top2 = torch.topk(logits, 2).values
            tokens.append(int(logits.argmax()))
            margins.append(float(top2[0] - top2[1]))
            seq.append(tokens[-1])
    return tokens, margins


def indexer_boundary_ties(model, ids: list[int]) -> tuple[int, int]:
    """(query rows whose k-th and (k+1)-th best visible indexer scores are exactly equal, rows where top-k selects)
    over every CSA layer of one oracle forward: the places where a tie rule decides the selection."""
    config = model.config
    ratio, topk = config.compress_rates["compressed_sparse_attention"], config.index_topk
    captured, hooks = [], []
    for layer in model.model.layers:
        comp = layer.self_attn.compressor
        if comp is not None and hasattr(comp, "indexer"):
            hooks.append(comp.indexer.scorer.register_forward_hook(lambda m, a, out: captured.append(out)))
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    ties = selecting = 0
    for scores in captured:  # [1, S, E]
        for t in range(scores.shape[1]):
            visible = scores[0, t, : (t + 1) // ratio]
            if visible.numel() > topk:
                selecting += 1
                top = torch.sort(visible, descending=True).values
                ties += int(top[topk - 1] == top[topk])
    return ties, selecting


def engine_greedy(runner: ModelRunner, prompt: list[int], steps: int) -> list[int]:
    seq = runner.allocate()
    try:
        logits = runner.forward([seq], [prompt])
        out = []
        for _ in range(steps):
            out.append(int(logits[0].argmax()))
            logits = runner.forward([seq], [[out[-1]]])
        return out
    finally:
        runner.free(seq)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_and_prefill_match_transformers(checkpoints, name, capsys):
    path = checkpoints[name]
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(path, max_seqs=4, max_seq_len=256)
    gen = torch.Generator().manual_seed(CONFIGS[name]["seed"])
    report = []
    for length in PROMPT_LENGTHS:
        prompt = torch.randint(16, 272, (length,), generator=gen).tolist()

        # prefill logits, every row, against the oracle's full forward
        seq = runner.allocate()
        got = runner.forward([seq], [prompt], all_logits=True)
        runner.free(seq)
        with torch.no_grad():
            want = oracle(torch.tensor([prompt])).logits[0]
        diff = float((got - want).abs().max())
        assert diff < PREFILL_LOGIT_BOUND, f"{name} L={length}: prefill logits differ by {diff:.3g}"

        mine = engine_greedy(runner, prompt, NEW_TOKENS)
        ref, margins = oracle_greedy(oracle, prompt, NEW_TOKENS)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        ties, selecting = indexer_boundary_ties(oracle, prompt + ref)
        tie_note = f"indexer top-k boundary ties {ties}/{selecting} selecting rows"
        if first is None:
            report.append(
                f"{name} L={length}: {NEW_TOKENS}/{NEW_TOKENS} greedy tokens equal, prefill diff {diff:.2e}, {tie_note}"
            )
        else:
            report.append(
                f"{name} L={length}: first difference at new token {first}, oracle top-2 margin "
                f"{margins[first]:.3g} (tie bound {TIE_MARGIN}), {tie_note}"
            )
            assert margins[first] < TIE_MARGIN, report[-1]
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_shipped_default_model_matches_transformers_on_lane_prompts(capsys):
    """The trained default model (evalpipe-skills-dsv4), or the checkpoint $EVALPIPE_ORACLE_MODEL names (a folder or a
    built-in name, as `evalpipe serve --model` takes it), on held-out lane prompts: same greedy tokens as transformers'
    full-sequence forward, prefill logits within the bound."""
    from evalpipe.engine.model.weights import resolve_model
    from evalpipe.engine.tokenizer import has_hf_tokenizer, load_tokenizer
    from evalpipe.lanes import get_lane

    model = os.environ.get(ORACLE_MODEL_ENV) or None
    path, name = resolve_model(model)
    assert model is not None or name == "evalpipe-skills-dsv4"
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    runner = ModelRunner(model, max_seqs=2, max_seq_len=1024)
    tok = load_tokenizer(str(path) if has_hf_tokenizer(path) else None)  # what `evalpipe serve --model` encodes with
    report = []
    for lane, index, steps in (("arith", 0, 16), ("retrieval", 1, 8), ("copy", 0, 16)):
        prompt = tok.encode_prompt(get_lane(lane).items()[index].prompt)
        seq = runner.allocate()
        got = runner.forward([seq], [prompt], all_logits=True)
        runner.free(seq)
        with torch.no_grad():
            want = oracle(torch.tensor([prompt])).logits[0]
        diff = float((got - want).abs().max())
        assert diff < PREFILL_LOGIT_BOUND, f"{lane}: prefill logits differ by {diff:.3g}"
        mine = engine_greedy(runner, prompt, steps)
        ref, margins = oracle_greedy(oracle, prompt, steps)
        first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), None)
        assert first is None or margins[first] < TIE_MARGIN, (lane, first, margins[first])
        report.append(
            f"{name}, {lane}[{index}] ({len(prompt)} tokens): {steps}/{steps} greedy tokens "
            f"{'equal' if first is None else f'equal up to a tie at {first}'}, prefill diff {diff:.2e}"
        )
    with capsys.disabled():
        print("\n" + "\n".join(report))
