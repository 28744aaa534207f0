#!/bin/bash
# Call 21 (2026-12-07, stop 63): the CUDA exactness tests on this tree (the decode steps' merge/mix at 64 columns,
# 2 rows, 2 warps, c64695f; the engine's host work per step, 1c81339), then one served boot of this tree and one of this tree with 1c81339 reversed
# (.gpu/host.patch): bench C64 and GSM8K 1,314 at C64 each; then the engine stage in process
# (C1/C16/C64, prefill at 8,192-row chunks) as time allows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card21.txt
S=$(date +%s)
left() { echo $(( ${B:-575} - $(date +%s) + S )); }
L=/tmp/logs21; mkdir -p $L /tmp/http
pack() { cp /tmp/http/*.log /tmp/http/*.json $L/ 2>/dev/null; tar czf $OUT/call21_logs.tgz --exclude='*.safetensors' -C /tmp logs21; }
trap pack EXIT
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests pyproject.toml /tmp/base/ && (H=$PWD; cd /tmp/base && patch -R -p1 -s < $H/.gpu/host.patch) && echo "base tree ready"
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 150 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_padded_groups.py > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 2 $L/gpu_exactness.log
timeout 50 $P tests/engine/test_prefix_cache.py -k cuda > $L/prefix_cache_cuda.log 2>&1; echo "prefix rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/prefix_cache_cuda.log; pack
timeout $(( $(left) - 130 )) python3 .gpu/host_ab.py --out /tmp/http --base /tmp/base --data-dir /tmp/data --order new,base > $L/host_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/host_ab.log | tail -n 5 | cut -c1-300
grep -h "generated tok/s" /tmp/http/serve-*.log | cut -c1-300 | tail -n 12
pack
[ $(left) -gt 60 ] && timeout $(( $(left) - 5 )) python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $L/rj > $L/rj.log 2>&1; echo "rj rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill chunk\|copy\|launch floor" $L/rj.log | cut -c1-200; pack
echo "done at $(( $(date +%s)-S ))s"
