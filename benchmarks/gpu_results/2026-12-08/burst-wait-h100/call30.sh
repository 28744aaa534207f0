#!/bin/bash
# Call 30 (2026-12-08, stop 65), the same machine as calls 26-29 just after them: `evalpipe serve --burst-wait-ms`
# 20 and 0, one boot each: `evalpipe bench` C64 and C1 (3 rounds each), `evalpipe run gsm8k` 1,314 at C64 (what a
# 20 ms burst wait costs a client that sends one request at a time, and the GSM8K job).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card30.txt
S=$(date +%s)
L=/tmp/logs30; mkdir -p $L /tmp/http30
pack() { cp /tmp/http30/*.log /tmp/http30/*.json $L/ 2>/dev/null; find $L -name "*.safetensors" -delete; tar czf $OUT/call30_logs.tgz -C /tmp logs30; }
trap pack EXIT
timeout 280 python3 .gpu/burst_ab.py --out /tmp/http30 --data-dir /tmp/data --arms 20,0 --c1 > $L/burst_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/burst_ab.log | tail -n 6 | cut -c1-400
for f in /tmp/http30/serve-*.log; do echo "$f"; grep -h "generated tok/s" $f | cut -c100-330 | tail -n 5; done
echo "done at $(( $(date +%s)-S ))s"
