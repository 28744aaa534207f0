#!/bin/bash
# down "rows" vs "mm" and the attention kernel's stop after the last visible entry: the MoE kernel sweep at T 32 and
# 64; the decode step in process at batch 64/32/1 on the tree without the attention change (base), this tree (mm,
# rows, rows, mm), base again; then the CUDA exactness tests on this tree with the sweep's rows shape in MM_LARGE.
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
S=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests /tmp/base && (cd /tmp/base && patch -R -p1 -s < $OLDPWD/.gpu/attn.diff) || exit 1
timeout 100 python3 -m benchmarks.kernels.step_moe_gpu --ts 64 --shapes 8x2 > $OUT/step_moe_rows.log 2>&1; echo "sweep rc $? $(( $(date +%s)-S ))s"
grep -E "down    us|gate_up us|FAILED|^E|^shape" $OUT/step_moe_rows.log | cut -c1-1200
AB="python3 $PWD/.gpu/moe_ab.py /tmp $OUT/step_moe_rows.log"
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout 70 $AB mm base1 > $OUT/ab_base1.log 2>&1); echo "base1 rc $? $(( $(date +%s)-S ))s"
timeout 110 $AB rows,mm new > $OUT/ab_new.log 2>&1; echo "new rc $? $(( $(date +%s)-S ))s"

grep -h -E "^(base|new)|rows shape" $OUT/ab_base1.log $OUT/ab_new.log $OUT/ab_base2.log
tail -3 $OUT/ab_new.log | cut -c1-300
timeout 60 $AB "" patch patch > $OUT/ab_patch.log 2>&1; tail -1 $OUT/ab_patch.log
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout $(( 430 - $(date +%s) + S )) $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py > $OUT/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
tail -3 $OUT/gpu_exactness.log
