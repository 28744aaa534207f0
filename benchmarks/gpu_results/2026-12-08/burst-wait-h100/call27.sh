#!/bin/bash
# Call 27 (2026-12-08, stop 65), the same machine as call 26 just after it: test_lost_device again with 240 s (call
# 26's 60 s ran out in its CUDA test, the first CUDA boot on a cold Triton cache), then `evalpipe serve
# --burst-wait-ms` 0, 5 and 0 again, one boot each, `evalpipe bench` C64 and `evalpipe run gsm8k` 1,314 at C64
# (call 26's first arm, burst 0, compiled the prompt kernels' shapes in its rounds).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card27.txt
S=$(date +%s)
L=/tmp/logs27; mkdir -p $L /tmp/http27
pack() { cp /tmp/http27/*.log /tmp/http27/*.json $L/ 2>/dev/null; find $L -name "*.safetensors" -delete; tar czf $OUT/call27_logs.tgz -C /tmp logs27; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 240 $P -v tests/engine/test_lost_device.py > $L/lost_device.log 2>&1; echo "lost-device pytest rc $? $(( $(date +%s)-S ))s"; tail -n 3 $L/lost_device.log; pack
timeout 300 python3 .gpu/burst_ab.py --out /tmp/http27 --data-dir /tmp/data --arms 0,5,0 > $L/burst_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/burst_ab.log | tail -n 4 | cut -c1-400
for f in /tmp/http27/serve-*.log; do echo "$f"; grep -h "generated tok/s" $f | cut -c100-330 | tail -n 8; done
echo "done at $(( $(date +%s)-S ))s"
