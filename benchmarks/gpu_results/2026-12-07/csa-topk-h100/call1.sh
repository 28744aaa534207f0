#!/bin/bash
# Call 1 (2026-12-06 night), in order of need: csa_topk checked and timed against the chain it replaced; the engine
# stage in process on this tree (361568d); one `evalpipe serve` boot with `evalpipe bench` C64/C16 and `evalpipe run
# gsm8k` 1,314 at C64; the CUDA exactness tests; in the time left, the engine stage on the tree before (e6cba8f: this tree
# with .gpu/base_files, the two files of the change as they were; this tree's gpu_real_job.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
rm -rf .gpu/base && mkdir -p .gpu/base && cp -r evalpipe benchmarks tests pyproject.toml .gpu/base/ && cp -r .gpu/base_files/. .gpu/base/
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
S=$(date +%s)
left() { echo $(( 585 - $(date +%s) + S )); }
timeout 60 python3 -m benchmarks.kernels.csa_topk_gpu > $OUT/csa_topk.log 2>&1; echo "csa_topk rc $? $(( $(date +%s)-S ))s"
tail -n 12 $OUT/csa_topk.log
timeout 150 python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $OUT/rj_new > $OUT/rj_new.log 2>&1; echo "rj_new rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill chunk\|copy\|launch floor\|step kernels" $OUT/rj_new.log | cut -c1-220
mkdir -p /tmp/http
timeout 100 python3 .gpu/http_ab.py --out /tmp/http --base .gpu/base --order new --data-dir /tmp/data > $OUT/http_ab.log 2>&1; echo "http rc $? $(( $(date +%s)-S ))s"
cp /tmp/http/*.log /tmp/http/http_ab.json $OUT/ 2>/dev/null
tail -n 3 $OUT/http_ab.log
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 150 $P tests/engine/test_engine_deterministic.py tests/engine/test_cuda_graphs.py > $OUT/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
tail -n 3 $OUT/gpu_exactness.log
timeout 90 $P tests/engine/test_prefix_cache.py -k cuda > $OUT/prefix_cache_cuda.log 2>&1; echo "prefix pytest rc $? $(( $(date +%s)-S ))s"
tail -n 3 $OUT/prefix_cache_cuda.log
# the tree before, if time is left
[ $(left) -gt 100 ] && { (cd .gpu/base && timeout $(( $(left) - 3 )) python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $OUT/rj_base > $OUT/rj_base.log 2>&1); echo "rj_base rc $? $(( $(date +%s)-S ))s"; grep "decode batch\|prefill chunk\|launch floor\|step kernels" $OUT/rj_base.log | cut -c1-220; }
