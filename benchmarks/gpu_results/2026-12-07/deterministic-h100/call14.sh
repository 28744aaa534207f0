#!/bin/bash
# Call 14 (2026-12-07): --deterministic's C64 decode step against the default on this tree (gate_up block_k 128,
# 4 stages), on whatever card comes (`invariant_gemm_gpu --no-sweep`, profiled steps of both modes).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card14.txt
S=$(date +%s)
L=/tmp/logs14; mkdir -p $L
pack() { find $L -name "*.safetensors" -delete; tar czf $OUT/call14_logs.tgz -C /tmp logs14; }
trap pack EXIT
timeout 300 python3 -m benchmarks.kernels.invariant_gemm_gpu --no-sweep --out $L/inv > $L/inv.log 2>&1; echo "inv rc $? $(( $(date +%s)-S ))s"
grep -v "^ *[0-9]* x" $L/inv.log | tail -n 25 | cut -c1-220
echo "done at $(( $(date +%s)-S ))s"
