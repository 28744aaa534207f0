#!/bin/bash
# Call 28 (2026-12-08, stop 65), the same machine as calls 26-27 just after them: the engine stage in process on this
# tree (gpu_real_job --stages engine --chunks 8192,8192), then the --deterministic step beside the default
# (invariant_gemm_gpu --no-sweep) with the time left.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card28.txt
S=$(date +%s)
L=/tmp/logs28; mkdir -p $L
pack() { find $L -name "*.safetensors" -delete; tar czf $OUT/call28_logs.tgz -C /tmp logs28; }
trap pack EXIT
timeout 270 python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $L/rj > $L/rj.log 2>&1; echo "rj rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill\|copy\|launch floor\|mixed step\|failed\|weight-read" $L/rj.log | cut -c1-220; pack
timeout 150 python3 -m benchmarks.kernels.invariant_gemm_gpu --no-sweep --out $L/inv > $L/inv.log 2>&1; echo "inv rc $? $(( $(date +%s)-S ))s"
tail -n 8 $L/inv.log | cut -c1-220
echo "done at $(( $(date +%s)-S ))s"
