#!/bin/bash
# Call 22 (2026-12-07, stop 63): on this tree (ec43451: padding windows of a padded group keep inside the RoPE
# table), the padded-group and prefix-cache CUDA tests, the engine stage in process (C1/C16/C64 at 128 and C64 at
# 3,500 tokens of context, the mixed step, prefill at 8,192-row chunks), then one served boot of this tree and one
# of this tree with 1c81339 reversed (.gpu/host.patch): bench C64 and GSM8K 1,314 at C64 each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card22.txt
S=$(date +%s)
left() { echo $(( ${B:-575} - $(date +%s) + S )); }
L=/tmp/logs22; mkdir -p $L /tmp/http
pack() { cp /tmp/http/*.log /tmp/http/*.json $L/ 2>/dev/null; tar czf $OUT/call22_logs.tgz --exclude='*.safetensors' -C /tmp logs22; }
trap pack EXIT
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests pyproject.toml /tmp/base/ && (H=$PWD; cd /tmp/base && patch -R -p1 -s < $H/.gpu/host.patch) && echo "base tree ready"
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 90 $P tests/engine/test_padded_groups.py tests/engine/test_prefix_cache.py -k "cuda or late" > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/gpu_exactness.log
timeout 200 python3 -m benchmarks.serving.gpu_real_job --stages engine --chunks 8192,8192 --gsm8k-examples 0 --out $L/rj > $L/rj.log 2>&1; echo "rj rc $? $(( $(date +%s)-S ))s"
grep "decode batch\|prefill chunk\|copy\|launch floor\|mixed step\|failed" $L/rj.log | cut -c1-220; pack
timeout $(( $(left) - 5 )) python3 .gpu/host_ab.py --out /tmp/http --base /tmp/base --data-dir /tmp/data --order new,base > $L/host_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/host_ab.log | tail -n 4 | cut -c1-300
grep -h "generated tok/s" /tmp/http/serve-*.log | cut -c100-330 | tail -n 16
echo "done at $(( $(date +%s)-S ))s"
