#!/bin/bash
# Call 29 (2026-12-08, stop 65), the same machine as calls 26-28 just after them: `evalpipe serve --burst-wait-ms`
# 20, 0 and 20, one boot each, `evalpipe bench` C64 only (a bench round's 64 prompts came as two prompt steps at 0
# and 5 ms in call 27).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card29.txt
S=$(date +%s)
L=/tmp/logs29; mkdir -p $L /tmp/http29
pack() { cp /tmp/http29/*.log /tmp/http29/*.json $L/ 2>/dev/null; find $L -name "*.safetensors" -delete; tar czf $OUT/call29_logs.tgz -C /tmp logs29; }
trap pack EXIT
timeout 200 python3 .gpu/burst_ab.py --out /tmp/http29 --data-dir /tmp/data --arms 20,0,20 --gsm8k 0 > $L/burst_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/burst_ab.log | tail -n 4 | cut -c1-400
for f in /tmp/http29/serve-*.log; do echo "$f"; grep -h "generated tok/s" $f | cut -c100-330 | tail -n 5; done
echo "done at $(( $(date +%s)-S ))s"
