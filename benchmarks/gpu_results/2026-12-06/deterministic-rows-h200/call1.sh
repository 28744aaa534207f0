#!/bin/bash
# One call: --deterministic with MoE down as "rows" and bmm as 64-row slabs (C64 profile of both modes: the ratio;
# the CUDA exactness tests; the identity arms on 128 prompts), merge/mix at 64 rows (per-row and GEMM-tile kernels),
# then the engine stage in process (decode at batch 1/16/64, prefill at 8,192-row chunks).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
S=$(date +%s)
left() { echo $(( 585 - $(date +%s) + S )); }
timeout 150 python3 -m benchmarks.kernels.invariant_gemm_gpu --no-sweep --out $OUT/inv > $OUT/inv.log 2>&1; echo "inv rc $? $(( $(date +%s)-S ))s"
grep "ms per step" $OUT/inv.log
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 130 $P tests/engine/test_engine_deterministic.py tests/engine/test_cuda_graphs.py > $OUT/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
tail -n 3 $OUT/gpu_exactness.log
timeout 170 python3 -m benchmarks.serving.deterministic_gpu --data-dir /tmp/data --modes deterministic --c1-prompts 64 --out $OUT/det > $OUT/det.log 2>&1; echo "det rc $? $(( $(date +%s)-S ))s"
tail -n 12 $OUT/det.log
timeout $(( $(left) - 90 )) python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $OUT/rj_engine > $OUT/rj_engine.log 2>&1; echo "rj_engine rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill chunk\|copy" $OUT/rj_engine.log | cut -c1-200
timeout 44 python3 -m benchmarks.kernels.step_hyper_gpu --tokens 64 --sweep > $OUT/hyper64.log 2>&1; echo "hyper64 rc $? $(( $(date +%s)-S ))s"
timeout 44 python3 -m benchmarks.kernels.step_hyper_gpu --tokens 64 --sweep --dot-min-rows 16 > $OUT/hyper64dot.log 2>&1; echo "hyper64dot rc $? $(( $(date +%s)-S ))s"
grep -h -A2 "^ *T " $OUT/hyper64.log $OUT/hyper64dot.log; grep -h "FAIL\|all checks" $OUT/hyper64*.log
