"""The native serving engine: a DeepSeek-V4 model, its CUDA-graph step, block speculation and the serving loop.

The server (evalpipe/server) calls `build.build(settings)` for a runner and a decoder and runs them in an `Engine`.
- engine.py: the loop (one background thread; each step is one forward); scheduler.py: admission, prefill chunks,
  decode rows; sampling.py: the per-request distribution and draws; tokenizer.py: tokenizers and detokenizers;
  grammar.py: xgrammar constraints (tools, response formats) masking every sampled and verified row;
- runner.py: ModelRunner, the model half (weights, slots, forward, truncate); cache.py: the paged state pools;
  forward_batch.py: one forward's rows and their addresses in the pools;
- model/: the eager model; static/: the same forward as a fixed-shape CUDA-graph step; spec/: block speculation.
Kernels live in evalpipe/kernels; nothing here imports the evaluation harness.
"""
