"""The fixed-shape decode/verify step: its input buffer (batch.py), the capture-safe forward over the model's own
layers (model.py, StaticModel, calling evalpipe.kernels) and GraphRunner (graphs.py), which captures the step as CUDA
graphs per batch bucket and width. Built by engine/build.py on CUDA; runs eagerly on the CPU in tests."""
