#!/bin/bash
# Call 23 (2026-12-07, stop 63): on this tree (d52bc00), the CUDA exactness tests (test_cuda_graphs,
# test_engine_deterministic, test_padded_groups, test_prefix_cache -k cuda), --deterministic's C64 decode step
# against the default's (invariant_gemm_gpu --no-sweep), then the engine stage again (a second sample of C1/C16/C64
# and prefill at 8,192-row chunks on this machine).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card23.txt
S=$(date +%s)
left() { echo $(( ${B:-500} - $(date +%s) + S )); }
L=/tmp/logs23; mkdir -p $L
pack() { find $L -name "*.safetensors" -delete; tar czf $OUT/call23_logs.tgz -C /tmp logs23; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 200 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_padded_groups.py tests/engine/test_prefix_cache.py -k "not test_prefix_cache or cuda" > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/gpu_exactness.log; pack
timeout 160 python3 -m benchmarks.kernels.invariant_gemm_gpu --no-sweep --out $L/inv > $L/inv.log 2>&1; echo "inv rc $? $(( $(date +%s)-S ))s"
grep -i "per step\|default\|determin" $L/inv.log | grep -v Warning | head -n 8 | cut -c1-220; pack
[ $(left) -gt 70 ] && timeout $(( $(left) - 5 )) python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192,8192 --gsm8k-examples 0 --out $L/rj > $L/rj.log 2>&1; echo "rj rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill chunk\|copy\|launch floor\|mixed step\|failed" $L/rj.log | cut -c1-220
echo "done at $(( $(date +%s)-S ))s"
