#!/bin/bash
# --deterministic's CUDA-graph step on 64-row library GEMMs (slab_matmul) vs the Triton tiles: C64 decode profile of
# both trees (old: change.diff reversed), the deterministic exactness arms on the new tree, then the CUDA tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests /tmp/base && (cd /tmp/base && patch -R -p1 -s < $OLDPWD/.gpu/change.diff) || exit 1
grep -c slab_matmul evalpipe/kernels/batch_invariant.py /tmp/base/evalpipe/kernels/batch_invariant.py
S=$(date +%s)
timeout 130 python3 -m benchmarks.kernels.invariant_gemm_gpu --no-sweep --out $OUT/inv_new > $OUT/inv_new.log 2>&1; echo "inv_new rc $? $(( $(date +%s)-S ))s"
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout 130 python3 -m benchmarks.kernels.invariant_gemm_gpu --no-sweep --out $OUT/inv_old > $OUT/inv_old.log 2>&1); echo "inv_old rc $? $(( $(date +%s)-S ))s"
grep "ms per step" $OUT/inv_new.log $OUT/inv_old.log
timeout 200 python3 -m benchmarks.serving.deterministic_gpu --modes deterministic --c1-prompts 64 --out $OUT/det_new > $OUT/det_new.log 2>&1; echo "det_new rc $? $(( $(date +%s)-S ))s"
tail -12 $OUT/det_new.log
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout $(( 590 - $(date +%s) + S )) $P tests/engine/test_engine_deterministic.py tests/kernels/test_batch_invariant.py tests/engine/test_cuda_graphs.py > $OUT/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
tail -5 $OUT/gpu_exactness.log
