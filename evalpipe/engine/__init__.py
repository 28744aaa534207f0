"""The native serving engine: a DeepSeek-V4 model, its CUDA-graph step, block speculation and the serving loop.

The server (evalpipe/server) spawns process.py, which calls `build.build(settings)` for a runner and a decoder, runs
them in an `Engine` (loop.py) and talks to the server with the messages of ipc.py.
- The HTTP process imports only the torch-free modules: process.py (the spawn target), ipc.py (the messages and
  `SeqEvent`), sampling_params.py, grammar_spec.py, tokenizer.py, model/names.py, spec/settings.py, faults.py
  (the planted faults of `--debug-fault`).
- engine.py: one step is one forward; loop.py: the engine process's loop; scheduler.py: admission, prefill chunks,
  decode rows; sampling.py: the per-request distribution and draws; tokenizer.py: tokenizers and detokenizers;
  grammar.py: xgrammar constraints (tools, response formats) masking every sampled and verified row;
- runner.py: ModelRunner, the model half (weights, slots, forward, truncate); cache.py: the paged state pools;
  forward_batch.py: one forward's rows and their addresses in the pools;
- model/: the eager model; static/: the same forward as a fixed-shape CUDA-graph step; spec/: block speculation.
Kernels live in evalpipe/kernels; nothing here imports the evaluation harness.
"""
