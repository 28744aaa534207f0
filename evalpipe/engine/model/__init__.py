"""The eager DeepSeek-V4 model for serving: config and weights, the layers (attention with its compressors and
indexer, mHC hyper-connections, MoE), the decoder stack (deepseek_v4.py) and its fused sites (fused_sites.py).
Built by ModelRunner (engine/runner.py); the static step (engine/static) runs the same layer objects."""
