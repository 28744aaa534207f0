#!/bin/bash
# Call 12 (2026-12-07): the targets again on this tree (gate_up block_k 128, 4 stages): the CUDA exactness tests,
# the engine stage (C1/C16/C64 in process, prefill at 8,192-row chunks twice), then one `evalpipe serve` boot with
# `evalpipe bench` C64/C16 and `evalpipe run gsm8k` 1,314 at C64 (.gpu/http_ab.py --order new).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card12.txt
S=$(date +%s)
left() { echo $(( ${B:-560} - $(date +%s) + S )); }
L=/tmp/logs12; mkdir -p $L /tmp/http
pack() { find $L /tmp/http -name "*.safetensors" -delete; cp /tmp/http/*.log /tmp/http/http_ab.json $L/ 2>/dev/null; tar czf $OUT/call12_logs.tgz -C /tmp logs12; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 60 $P tests/engine/test_prefix_cache.py -k cuda > $L/prefix_cache_cuda.log 2>&1; echo "prefix pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/prefix_cache_cuda.log
timeout 150 python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $L/rj > $L/rj.log 2>&1; echo "rj rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill chunk\|copy\|launch floor" $L/rj.log | cut -c1-200
if [ $(left) -gt 100 ]; then
  timeout $(( $(left) - 5 )) python3 .gpu/http_ab.py --out /tmp/http --base . --order new --data-dir /tmp/data > $L/http_ab.log 2>&1; echo "http rc $? $(( $(date +%s)-S ))s"
  tail -n 6 $L/http_ab.log | cut -c1-300
fi
echo "done at $(( $(date +%s)-S ))s"
