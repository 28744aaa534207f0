"""The native serving engine: a DeepSeek-V4 model, its CUDA-graph step, block speculation and the serving loop.

The server (evalpipe/server) spawns process.py with an `EngineConfig` (config.py: every engine setting and its
default); process.py calls `build.build(config)` for a runner and a decoder, and loop.py's `EngineLoop` runs them in
an `Engine` (engine.py) and talks to the server with the messages of ipc.py.
- The HTTP process imports only the torch-free modules: config.py, process.py (the spawn target), ipc.py (the
  messages and `SeqEvent`), sampling_params.py, grammar_constraint.py, tokenizer.py, model/names.py,
  spec/settings.py, faults.py (the planted faults of `--debug-fault`).
- contracts.py: the `Runner` and `Decoder` contracts the engine calls; engine.py: `Engine`, one step is one forward;
  commit.py: a step's logits become committed tokens (grammar masks, min_tokens bans, the decoder's accept);
  output.py: committed tokens become text, stops, logprobs and events; plain_decoder.py: decoding without drafts;
  loop.py: the engine process's loop (device_loss.py: a step that left the device unable to run anything ends
  it); scheduler.py: `Sequence`, admission, prefill chunks, decode rows;
  sampling.py: the per-request distribution and draws (keyed.py: the counter-based noise of --deterministic);
  tokenizer.py: tokenizers and detokenizers; grammar.py: xgrammar matchers (tools, response formats) masking every
  sampled and verified row;
- runner.py: ModelRunner, the model half (weights, slots, forward, truncate, drafter views) and its optional prefix
  cache (prefix_cache.py: full pages indexed by their tokens, shared by reference count); cache.py: the paged state
  pools; forward_batch.py: one forward's rows and their addresses in the pools; host_to_device.py: host tensors to
  the device without a stream sync; tokenizer_files.py: the byte-level
  tokenizer as Hugging Face files; build.py: the runner and decoder of an `EngineConfig`;
- model/: the eager model; static/: the same forward as a fixed-shape CUDA-graph step; spec/: block speculation.
Kernels live in evalpipe/kernels; nothing here imports the evaluation harness.
"""
