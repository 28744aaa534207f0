#!/bin/bash
# Call 26 (2026-12-08, stop 65): on this tree (1ebec3e: a lost device ends the engine), test_lost_device (its CUDA
# test: a device-side assert ends the engine, 503 engine_dead, serve exits 1) and the CUDA exactness tests
# (test_cuda_graphs, test_engine_deterministic, test_padded_groups, test_prefix_cache -k cuda); then three
# `evalpipe serve` boots (.gpu/burst_ab.py): --burst-wait-ms 0, 5, and 5 with --prefill-delay-factor 0.25, each
# `evalpipe bench` C64 (3 rounds) and `evalpipe run gsm8k` 1,314 at C64, prefix cache on.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card26.txt
S=$(date +%s)
left() { echo $(( ${B:-420} - $(date +%s) + S )); }
L=/tmp/logs26; mkdir -p $L /tmp/http
pack() { cp /tmp/http/*.log /tmp/http/*.json $L/ 2>/dev/null; find $L -name "*.safetensors" -delete; tar czf $OUT/call26_logs.tgz -C /tmp logs26; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 60 $P tests/engine/test_lost_device.py > $L/lost_device.log 2>&1; echo "lost-device pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/lost_device.log; pack
timeout 190 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_padded_groups.py tests/engine/test_prefix_cache.py -k "not test_prefix_cache or cuda" > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/gpu_exactness.log; pack
[ $(left) -gt 60 ] && timeout $(( $(left) - 3 )) python3 .gpu/burst_ab.py --out /tmp/http --data-dir /tmp/data --arms 0,5,5:0.25 > $L/burst_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/burst_ab.log | tail -n 5 | cut -c1-400
for f in /tmp/http/serve-*.log; do echo "$f"; grep -h "generated tok/s" $f | cut -c100-330 | tail -n 8; done
echo "done at $(( $(date +%s)-S ))s"
