#!/bin/bash
# second call on the warm machine: the CUDA engine tests alone (tests/kernels sets the interpreter for its folder, so
# it does not share a pytest process with them), then the deterministic arms on the old tree and the default mode.
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 EVALPIPE_DATA_DIR=/tmp/data
S=$(date +%s)
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests /tmp/base && (cd /tmp/base && patch -R -p1 -s < $OLDPWD/.gpu/change.diff) || exit 1
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 260 $P tests/engine/test_engine_deterministic.py tests/engine/test_cuda_graphs.py > $OUT/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
tail -4 $OUT/gpu_exactness.log
timeout 60 $P tests/engine/test_prefix_cache.py -k cuda >> $OUT/gpu_exactness.log 2>&1; echo "pytest prefix rc $? $(( $(date +%s)-S ))s"
tail -2 $OUT/gpu_exactness.log
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout 170 python3 -m benchmarks.serving.deterministic_gpu --modes deterministic --c1-prompts 64 --out $OUT/det_old > $OUT/det_old.log 2>&1); echo "det_old rc $? $(( $(date +%s)-S ))s"
tail -10 $OUT/det_old.log
timeout $(( 580 - $(date +%s) + S )) python3 -m benchmarks.serving.deterministic_gpu --modes default --c1-prompts 64 --drafters ngram --out $OUT/det_default > $OUT/det_default.log 2>&1; echo "det_default rc $? $(( $(date +%s)-S ))s"
tail -10 $OUT/det_default.log
