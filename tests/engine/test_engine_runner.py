"""ModelRunner behaviour that serving and speculation rely on: the seeded default checkpoint, batch independence,
chunked prefill, rollback (truncate) and pool accounting. CPU, float32, the default tiny model."""

from __future__ import annotations

import pytest
import torch

from evalpipe.engine.model.config import config_hash, tiny_config
from evalpipe.engine.model.names import TINY_MODEL_NAME
from evalpipe.engine.model.weights import init_tiny_weights, load_state_dict
from evalpipe.engine.runner import ModelRunner, PoolExhausted
from tests.support.engine_state import state_snapshot

LOGIT_TOL = 2e-5  # same math, different batch shapes: float32 reassociation only


@pytest.fixture(scope="module")
def runner(tiny_runner):
    return tiny_runner(max_seqs=40, max_seq_len=512)


def greedy(runner, seq, logits, steps):
    out = []
    for _ in range(steps):
        out.append(int(logits[0].argmax()))
        logits = runner.forward([seq], [[out[-1]]])
    return out


def prompt(n, seed):
    return torch.randint(16, 272, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_default_checkpoint_is_seeded_cached_and_loadable_by_transformers(runner, cache_dir):
    config = tiny_config()
    assert runner.model_name == TINY_MODEL_NAME
    assert runner.config.vocab_size == 512 and runner.config.bos_token_id == 0 and runner.config.eos_token_id == 1
    assert set(runner.config.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(runner.config.mlp_layer_types) == {"moe", "hash_moe"}
    assert runner.config.compress_rates["heavily_compressed_attention"] == 2
    path = runner.model_path
    assert path.startswith(str(cache_dir)) and config_hash(config) in path
    info = runner.describe()
    assert 1_000_000 < info["parameters"] < 20_000_000 and info["dtype"] == "float32"
    assert info["pools"]["max_seqs"] == 40

    on_disk = load_state_dict(path)
    fresh = init_tiny_weights(config, seed=0)
    assert on_disk.keys() == fresh.keys()
    assert all(torch.equal(on_disk[k], fresh[k]) for k in fresh)

    transformers = pytest.importorskip("transformers")
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = prompt(40, 0)
    seq = runner.allocate()
    got = runner.forward([seq], [ids], all_logits=True)
    runner.free(seq)
    with torch.no_grad():
        want = oracle(torch.tensor([ids])).logits[0]
    assert float((got - want).abs().max()) < 1e-4


def test_same_request_alone_and_among_32_concurrent(runner):
    target, steps = prompt(37, 1), 32
    seq = runner.allocate()
    alone = greedy(runner, seq, runner.forward([seq], [target]), steps)
    runner.free(seq)

    others = [runner.allocate() for _ in range(32)]
    lengths = [1 + (7 * i) % 61 for i in range(32)]
    seq = runner.allocate()
    # half the others prefill together with the target; the rest join while it is decoding (mixed batches)
    first = others[:16]
    logits = runner.forward(first + [seq], [prompt(lengths[i], 100 + i) for i in range(16)] + [target])
    nxt = {s: int(logits[i].argmax()) for i, s in enumerate(first + [seq])}
    mine, late = [], list(zip(others[16:], range(16, 32)))
    for step in range(steps):
        mine.append(nxt[seq])
        seqs = list(nxt)
        toks = [[nxt[s]] for s in seqs]
        if step % 3 == 1 and late:  # a new request's prefill chunk rides along with the decodes
            s, i = late.pop()
            seqs.append(s)
            toks.append(prompt(lengths[i], 100 + i))
        logits = runner.forward(seqs, toks)
        nxt = {s: int(logits[i].argmax()) for i, s in enumerate(seqs)}
    for s in others + [seq]:
        runner.free(s)
    assert mine == alone


def test_chunked_prefill_equals_one_shot(runner):
    ids = prompt(100, 2)
    a, b = runner.allocate(), runner.allocate()
    one_shot = runner.forward([a], [ids], all_logits=True)
    chunks, rows, at = [13, 1, 30, 2, 54], [], 0
    for c in chunks:
        rows.append(runner.forward([b], [ids[at : at + c]], all_logits=True))
        at += c
    chunked = torch.cat(rows)
    assert chunked.shape == one_shot.shape
    assert float((chunked - one_shot).abs().max()) < LOGIT_TOL
    assert greedy(runner, a, one_shot[-1:], 16) == greedy(runner, b, chunked[-1:], 16)
    runner.free(a)
    runner.free(b)


def _assert_same_state(x, y, tol):
    assert x.keys() == y.keys()
    for k in x:
        assert x[k].shape == y[k].shape, k
        if x[k].numel():
            assert float((x[k] - y[k]).abs().max()) <= tol, k


@pytest.mark.parametrize("rejected", [1, 5, 31, 45])
def test_truncate_then_diverge_equals_fresh(runner, rejected):
    """Append a prefix, then `rejected` tokens, roll back, append a different continuation: logits and state
    equal a sequence that only ever saw prefix + continuation (45 > rollback margin -> re-prefill path)."""
    prefix, bad, good = prompt(61, 3), prompt(rejected, 4), prompt(6, 5)
    a, b = runner.allocate(), runner.allocate()
    runner.forward([a], [prefix])
    runner.forward([a], [bad], all_logits=True)
    runner.truncate(a, len(prefix))
    assert runner.seq_len(a) == len(prefix) and runner.tokens(a) == prefix
    got = runner.forward([a], [good], all_logits=True)
    runner.forward([b], [prefix])
    want = runner.forward([b], [good], all_logits=True)
    exact = rejected <= runner.pools.margin
    if exact:  # the shallow path moves only the length: bit-identical
        assert torch.equal(got, want)
    assert float((got - want).abs().max()) < LOGIT_TOL
    _assert_same_state(state_snapshot(runner, a), state_snapshot(runner, b), 0.0 if exact else LOGIT_TOL)
    # and the sequences keep agreeing afterwards
    assert greedy(runner, a, got[-1:], 8) == greedy(runner, b, want[-1:], 8)
    runner.free(a)
    runner.free(b)


def test_slots_pages_and_validation(tiny_runner):
    small = tiny_runner(max_seqs=2, max_seq_len=256, num_pages=3)  # page = 64 tokens
    a, b = small.allocate(), small.allocate()
    with pytest.raises(PoolExhausted):
        small.allocate()
    small.forward([a], [prompt(130, 6)])  # 3 pages
    with pytest.raises(PoolExhausted):
        small.forward([b], [prompt(5, 7)])
    assert small.seq_len(b) == 0  # nothing appended on failure
    small.truncate(a, 100)  # frees the third page
    small.forward([b], [prompt(5, 7)])
    small.free(a)
    c = small.allocate()
    assert small.seq_len(c) == 0
    with pytest.raises(ValueError):
        small.forward([c], [[]])
    with pytest.raises(ValueError):
        small.forward([c], [[600]])
    with pytest.raises(ValueError):
        small.forward([c, c], [[5], [6]])
    with pytest.raises(ValueError):
        small.forward([c], [[5] * 257])
    with pytest.raises(ValueError):
        small.truncate(c, 3)
    with pytest.raises(KeyError):
        small.seq_len(99)


def test_indexer_tie_rule_prefers_lower_index_and_ignores_invisible():
    from evalpipe.engine.model.compressor import causal_topk

    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    visible = torch.tensor([[True] * 5 + [False] * 2])
    # best 1.0/2.0, then the tie at 0.0 goes to the lowest indices
    assert causal_topk(scores, visible, 3).tolist() == [[1, 4, 0]]
    assert causal_topk(scores, visible, 4).tolist() == [[1, 4, 0, 2]]
    # appending more (invisible or lower-scored) columns never changes the pick
    wider = torch.cat([scores, torch.full((1, 5), 9.0)], dim=1)
    wider_vis = torch.cat([visible, torch.zeros(1, 5, dtype=torch.bool)], dim=1)
    assert causal_topk(wider, wider_vis, 3).tolist() == [[1, 4, 0]]
    # fewer visible than k: the rest is -1
    assert causal_topk(scores, torch.tensor([[True, True] + [False] * 5]), 3).tolist() == [[1, 0, -1]]


def test_forward_is_causal_under_exact_indexer_ties(tmp_path):
    """One indexer head: about half of all indexer scores are exactly 0 (every ReLU closed), so top-k boundary
    ties are everywhere. The tie rule keeps the engine causal: a prefix's logits do not move when later tokens
    are appended (transformers' full forward breaks ties by length-dependent order and is not causal here)."""
    from evalpipe.engine.model.config import load_config
    from evalpipe.engine.model.weights import init_tiny_weights, save_checkpoint

    data = tiny_config().to_dict()
    data.update(
        index_n_heads=1,
        index_topk=2,
        num_hidden_layers=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],
    )
    for key in ("transformers_version", "architectures", "model_type", "qk_rope_head_dim"):
        data.pop(key, None)
    config = load_config(data)
    save_checkpoint(config, init_tiny_weights(config, seed=7), tmp_path / "ties")
    tied = ModelRunner(str(tmp_path / "ties"), max_seqs=2, max_seq_len=256)
    ids = prompt(120, 8)
    a, b = tied.allocate(), tied.allocate()
    short = tied.forward([a], [ids[:80]], all_logits=True)
    long = tied.forward([b], [ids], all_logits=True)
    assert float((short - long[:80]).abs().max()) < LOGIT_TOL


def test_bfloat16_runner_tracks_float32(runner, tiny_runner):
    """`--dtype bfloat16` path: same model in bf16 (norms, sinks, mHC and biases stay float32 like transformers)
    stays close to float32 and decodes."""
    bf16 = tiny_runner(dtype=torch.bfloat16, max_seqs=2, max_seq_len=256)
    ids = prompt(80, 9)
    a, b = bf16.allocate(), runner.allocate()
    low = bf16.forward([a], [ids], all_logits=True)
    full = runner.forward([b], [ids], all_logits=True)
    runner.free(b)
    assert low.dtype == torch.float32 and low.shape == full.shape
    assert float((low - full).abs().max()) < 1.0  # bf16 rounding through 4 layers; logits span about +-4
    assert float((low.argmax(-1) == full.argmax(-1)).float().mean()) > 0.8
    assert bf16.forward([a], [[20]]).shape == (1, 512)
    assert bf16.describe()["dtype"] == "bfloat16"


def test_checkpoint_names_both_schemes_and_quantized_refused(runner, tmp_path):
    """save_pretrained (5.2x) writes the original DeepSeek names (attn.wq_a, ffn.experts.N.w1, hc_attn_fn, ...);
    a checkpoint saved with the module names of DeepseekV4ForCausalLM loads to the same tensors."""
    from safetensors.torch import save_file

    from evalpipe.engine.model.weights import load_state_dict

    original = load_state_dict(runner.model_path)
    (tmp_path / "modnames").mkdir()
    save_file({k: v.contiguous() for k, v in original.items()}, str(tmp_path / "modnames" / "model.safetensors"))
    renamed = load_state_dict(tmp_path / "modnames")
    assert renamed.keys() == original.keys()
    assert all(torch.equal(renamed[k], original[k]) for k in original)

    (tmp_path / "fp8").mkdir()
    save_file(
        {
            "layers.0.attn.wq_a.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
            "layers.0.attn.wq_a.scale": torch.ones(1, 1),
        },
        str(tmp_path / "fp8" / "model.safetensors"),
    )
    with pytest.raises(ValueError, match="quantized"):
        load_state_dict(tmp_path / "fp8")


def test_batched_verify_rows_then_partial_accept_equal_plain_decoding(runner):
    """The speculative-verify shape: 8 sequences x 6 rows in one forward (all_logits, request-major) equals six
    one-row decodes; then each sequence keeps a different prefix (truncate) and continues exactly like a
    sequence that only ever decoded the kept tokens."""
    lengths = [5, 23, 24, 31, 40, 47, 63, 64]
    prompts = [prompt(n, 20 + i) for i, n in enumerate(lengths)]
    drafts = [prompt(6, 40 + i) for i in range(8)]
    spec = [runner.allocate() for _ in lengths]
    plain = [runner.allocate() for _ in lengths]
    runner.forward(spec, prompts)
    runner.forward(plain, prompts)
    verify = runner.forward(spec, drafts, all_logits=True).view(8, 6, -1)
    steps = torch.stack([runner.forward(plain, [[d[j]] for d in drafts]) for j in range(6)], dim=1)
    assert float((verify - steps).abs().max()) < LOGIT_TOL

    accepted = [0, 1, 2, 3, 4, 5, 6, 2]  # rows kept per sequence (0..G+1 style)
    fresh = [runner.allocate() for _ in lengths]
    runner.forward(fresh, [p + d[:k] if k else p for p, d, k in zip(prompts, drafts, accepted)])
    for s, p, k in zip(spec, prompts, accepted):
        runner.truncate(s, len(p) + k)
    nxt = [[int(t)] for t in prompt(8, 60)]
    got = runner.forward(spec, nxt)
    want = runner.forward(fresh, nxt)
    assert float((got - want).abs().max()) < LOGIT_TOL
    for s, f in zip(spec, fresh):
        _assert_same_state(state_snapshot(runner, s), state_snapshot(runner, f), LOGIT_TOL)
    for s in spec + plain + fresh:
        runner.free(s)
