#!/bin/bash
# Call 17 (2026-12-07): the CUDA exactness tests on the padded-group tree (engine tests apart from the interpreter
# ones), then three `evalpipe serve` boots of this tree: default, --prefill-delay-factor 1, default again (bench
# C64/C16 and `evalpipe run gsm8k` 1,314 at C64 each).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card17.txt
S=$(date +%s)
left() { echo $(( ${B:-560} - $(date +%s) + S )); }
L=/tmp/logs17; mkdir -p $L /tmp/http
pack() { find $L /tmp/http -name "*.safetensors" -delete; cp /tmp/http/*.log /tmp/http/http_ab.json $L/ 2>/dev/null; tar czf $OUT/call17_logs.tgz -C /tmp logs17; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 120 python3 .gpu/prompt_groups.py /tmp/http --trials 2 > $L/prompt_groups.log 2>&1; echo "pg rc $? $(( $(date +%s)-S ))s"; grep "trial\|profiled" $L/prompt_groups.log | cut -c1-250
timeout 150 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_padded_groups.py > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 3 $L/gpu_exactness.log
timeout 60 $P tests/engine/test_prefix_cache.py -k cuda > $L/prefix_cache_cuda.log 2>&1; echo "prefix pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/prefix_cache_cuda.log
if [ $(left) -gt 130 ]; then
  timeout $(( $(left) - 5 )) python3 .gpu/http_ab.py --out /tmp/http --base . --order new,new:1,new --data-dir /tmp/data > $L/http_ab.log 2>&1; echo "http rc $? $(( $(date +%s)-S ))s"
  tail -n 5 $L/http_ab.log | cut -c1-300
fi
echo "done at $(( $(date +%s)-S ))s"
