#!/bin/bash
# Call 31 (2026-12-08, stop 65), the same machine as calls 26-30 just after them: the GSM8K job in process on this
# tree (.gpu/gsm8k_probe.py --runs 1 --no-profile), then `evalpipe serve --burst-wait-ms` 0 and 20 again (the
# reverse order of call 30), C64 and C1 bench and the GSM8K job served.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card31.txt
S=$(date +%s)
L=/tmp/logs31; mkdir -p $L /tmp/http31
pack() { cp /tmp/http31/*.log /tmp/http31/*.json $L/ 2>/dev/null; find $L -name "*.safetensors" -delete; tar czf $OUT/call31_logs.tgz -C /tmp logs31; }
trap pack EXIT
timeout 100 python3 .gpu/gsm8k_probe.py /tmp/probe31 /tmp/data --runs 1 --no-profile > $L/gsm8k_probe.log 2>&1; echo "probe rc $? $(( $(date +%s)-S ))s"
grep -v "^ *profiled" $L/gsm8k_probe.log | tail -n 12 | cut -c1-200; pack
timeout 160 python3 .gpu/burst_ab.py --out /tmp/http31 --data-dir /tmp/data --arms 0,20 --c1 > $L/burst_ab.log 2>&1; echo "ab rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/burst_ab.log | tail -n 6 | cut -c1-400
echo "done at $(( $(date +%s)-S ))s"
