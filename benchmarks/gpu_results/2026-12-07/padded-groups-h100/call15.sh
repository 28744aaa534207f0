#!/bin/bash
# Call 15 (2026-12-07): where a GSM8K-shaped prompt step goes: .gpu/prompt_groups.py (12 prompts continuing a
# 2,176-token context by ~300 rows as 12 groups, as 1 group, as one chunk), then the in-process GSM8K job
# (.gpu/gsm8k_probe.py, 1 run after a 64-prompt warm-up, steps filed by the prompt rows they fed).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card15.txt
S=$(date +%s)
L=/tmp/logs15; mkdir -p $L
pack() { find $L -name "*.safetensors" -delete; tar czf $OUT/call15_logs.tgz -C /tmp logs15; }
trap pack EXIT
timeout 150 python3 .gpu/prompt_groups.py $L/pg > $L/prompt_groups.log 2>&1; echo "pg rc $? $(( $(date +%s)-S ))s"
grep "trial\|profiled" $L/prompt_groups.log | cut -c1-400
grep -A 30 "cProfile" $L/prompt_groups.log | head -n 34 | cut -c1-160
timeout 200 python3 .gpu/gsm8k_probe.py $L/pg /tmp/data --runs 1 > $L/gsm8k_probe.log 2>&1; echo "gsm rc $? $(( $(date +%s)-S ))s"
grep -v "^ *[0-9]" $L/gsm8k_probe.log | cut -c1-300 | tail -n 20
echo "done at $(( $(date +%s)-S ))s"
