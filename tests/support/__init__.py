"""What the tests share and are not tests themselves: servers to talk to (scripted, fake engine, vLLM peer), the
process harness for `evalpipe serve`, command-line and run-folder helpers, and the baseline kernels (an oracle the
GPU benchmarks time too)."""
