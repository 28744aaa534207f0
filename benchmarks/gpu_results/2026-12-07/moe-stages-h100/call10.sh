#!/bin/bash
# Call 10 (2026-12-07), H200: MoE launch shapes around gate_up block_k 128 (the H100's winner in call 8, -30.7 us) at
# C64 in process (MOE_SET=k128 .gpu/moe_ab64.py); the best written into MM_LARGE when its median replay beats base's
# by 8 us or more (.gpu/pick_shape.py); then the CUDA exactness tests on that tree and the engine stage (C64 in process).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. MOE_SET=k128
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card10.txt
S=$(date +%s)
left() { echo $(( ${B:-560} - $(date +%s) + S )); }
L=/tmp/logs10; mkdir -p $L
pack() { find $L -name "*.safetensors" -delete; tar czf $OUT/call10_logs.tgz -C /tmp logs10; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 200 python3 .gpu/moe_ab64.py $L > $L/moe_ab64.log 2>&1; echo "moe_ab rc $? $(( $(date +%s)-S ))s"
grep -v Writing $L/moe_ab64.log | cut -c1-200
cp evalpipe/kernels/moe.py /tmp/moe_before.py
python3 .gpu/pick_shape.py $L/moe_ab64.json evalpipe/kernels/moe.py 2>&1 | tee $L/pick.log
diff -u /tmp/moe_before.py evalpipe/kernels/moe.py > $L/moe_patch.diff && echo "MM_LARGE unchanged" || cat $L/moe_patch.diff
if [ -s $L/moe_patch.diff ] && [ $(left) -gt 110 ]; then
  timeout 140 $P tests/engine/test_engine_deterministic.py tests/engine/test_cuda_graphs.py > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
  tail -n 3 $L/gpu_exactness.log
fi
if [ $(left) -gt 60 ]; then
  timeout $(( $(left) - 3 )) python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192 --gsm8k-examples 0 --out $L/rj > $L/rj.log 2>&1; echo "rj rc $? $(( $(date +%s)-S ))s"
  grep "decode batch\|prefill chunk\|copy\|launch floor\|step kernels" $L/rj.log | cut -c1-200
fi
echo "done at $(( $(date +%s)-S ))s"
