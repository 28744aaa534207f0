#!/bin/bash
# Call 16 (2026-12-07): prompt chunks of many lengths as one padded attention group. In one call: the prompt-step
# probe (padded vs one group per length), the in-process GSM8K job both ways, the CUDA exactness tests on the
# tree, then one `evalpipe serve` boot per tree (HEAD before the change in /tmp/base, then this tree): bench C64/C16
# and `evalpipe run gsm8k` 1,314 at C64.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
# the tree before the change: this tree with the three changed files as HEAD had them (.gpu/base_files)
mkdir -p /tmp/base && cp -r evalpipe pyproject.toml manifests datasets /tmp/base/ && cp -r .gpu/base_files/evalpipe /tmp/base/ && rm -rf /tmp/base/evalpipe/models && ln -s "$PWD/evalpipe/models" /tmp/base/evalpipe/models
diff -rq evalpipe /tmp/base/evalpipe | head
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card16.txt
S=$(date +%s)
left() { echo $(( ${B:-570} - $(date +%s) + S )); }
L=/tmp/logs16; mkdir -p $L /tmp/http
pack() { find $L /tmp/http -name "*.safetensors" -delete; cp /tmp/http/*.log /tmp/http/http_ab.json $L/ 2>/dev/null; tar czf $OUT/call16_logs.tgz -C /tmp logs16; }
trap pack EXIT
timeout 120 python3 .gpu/prompt_groups.py $L/pg > $L/prompt_groups.log 2>&1; echo "pg rc $? $(( $(date +%s)-S ))s"
grep "trial\|profiled" $L/prompt_groups.log | cut -c1-250
timeout 90 python3 .gpu/gsm8k_probe.py $L/pg /tmp/data --runs 1 --no-profile > $L/gsm8k_probe_new.log 2>&1; echo "gsm new rc $? $(( $(date +%s)-S ))s"
grep -A 8 "== run" $L/gsm8k_probe_new.log | cut -c1-250
timeout 90 python3 .gpu/gsm8k_probe.py $L/pg /tmp/data --runs 1 --no-profile --groups-per-count > $L/gsm8k_probe_before.log 2>&1; echo "gsm before rc $? $(( $(date +%s)-S ))s"
grep -A 8 "== run" $L/gsm8k_probe_before.log | cut -c1-250
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 150 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_padded_groups.py tests/kernels/test_eager_attention_kernel.py > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 3 $L/gpu_exactness.log
timeout 60 $P tests/engine/test_prefix_cache.py -k cuda > $L/prefix_cache_cuda.log 2>&1; echo "prefix pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/prefix_cache_cuda.log
if [ $(left) -gt 130 ]; then
  timeout $(( $(left) - 5 )) python3 .gpu/http_ab.py --out /tmp/http --base /tmp/base --order base,new --data-dir /tmp/data > $L/http_ab.log 2>&1; echo "http rc $? $(( $(date +%s)-S ))s"
  tail -n 4 $L/http_ab.log | cut -c1-300
fi
echo "done at $(( $(date +%s)-S ))s"
