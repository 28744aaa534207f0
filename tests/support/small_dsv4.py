"""A smaller random DeepSeek-V4 checkpoint than the default tiny model, for the kernel tests that run a whole model
through Triton's CPU interpreter (tests/kernels/test_static_step_triton.py, test_eager_attention_kernel.py).

The interpreter's cost grows with the rows and layers a forward runs, and the rows a test needs are set by the
boundaries it must cross: the sliding window and the CSA top-k selection. Against the tiny model this one has a
window of 8 (not 24), a top-2 indexer selection (not top-8), one layer of each attention kind (sliding, CSA, HCA;
MoE hash, then routed twice) instead of four layers, hidden size 128 (not 256: half the mHC merge/mix column
blocks) and 3 Sinkhorn iterations (not 20: the serial loop of the mHC pre-norm kernel, which dominated these
tests). The rest is the tiny model's: 4 heads of 64, CSA ratio 4, HCA ratio 2, E 8 top-2 MoE, 4 mHC streams.
"""

from __future__ import annotations

from pathlib import Path

WINDOW, TOPK, HIDDEN, SINKHORN_ITERS = 8, 2, 128, 3
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
MLP_LAYER_TYPES = ["hash_moe", "moe", "moe"]


def make_small_dsv4(out: Path, seed: int = 0) -> Path:
    """Write the checkpoint (config.json + safetensors, seeded random weights) into `out`; returns `out`."""
    from evalpipe.engine.model.config import load_config, tiny_config
    from evalpipe.engine.model.weights import init_tiny_weights, save_checkpoint

    data = tiny_config().to_dict()
    data.update(
        sliding_window=WINDOW,
        index_topk=TOPK,
        hidden_size=HIDDEN,
        hc_sinkhorn_iters=SINKHORN_ITERS,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=LAYER_TYPES,
        mlp_layer_types=MLP_LAYER_TYPES,
    )
    for key in ("transformers_version", "architectures", "model_type", "qk_rope_head_dim"):
        data.pop(key, None)
    config = load_config(data)
    return save_checkpoint(config, init_tiny_weights(config, seed=seed), Path(out))
