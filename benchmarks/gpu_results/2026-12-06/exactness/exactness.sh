#!/bin/bash
# Issue 47's exactness tests on the GPU, after the batched keyed sampler (engine/commit.py): CUDA graphs, the prefix
# cache's CUDA cases, deterministic mode, keyed sampling's CUDA cases.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 EVALPIPE_DATA_DIR=/nonexistent
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 100 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_keyed_sampling.py 2>&1 | tee $OUT/gpu_exactness.log
timeout 60 $P tests/engine/test_prefix_cache.py -k cuda 2>&1 | tee -a $OUT/gpu_exactness.log
