#!/bin/bash
# Call 18 (2026-12-07): mHC merge/mix at the C64 decode step. The chain alone for every shape, then the C64 step on a
# fresh runner (the kernel before first and last, the tree's, the best three); the best step shape is written into
# the tree's DECODE_MIX here (if it beats the tree's own by 8 us); then the CUDA exactness tests, one served boot
# (bench C64 with 1 and 4 client processes, GSM8K 1,314; the engine log times decode-only and prompt steps apart),
# and the in-process GSM8K job on the same machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card18.txt
S=$(date +%s)
left() { echo $(( ${B:-575} - $(date +%s) + S )); }
L=/tmp/logs18; mkdir -p $L /tmp/http
pack() { cp /tmp/http/*.log /tmp/http/*.json $L/ 2>/dev/null; tar czf $OUT/call18_logs.tgz --exclude='*.safetensors' -C /tmp logs18; }
trap pack EXIT
timeout 260 python3 .gpu/mix_sweep.py /tmp/http --budget 45 > $L/mix_sweep.log 2>&1; echo "sweep rc $? $(( $(date +%s)-S ))s"
grep "base chain\|step \|budget\|C1 " $L/mix_sweep.log | cut -c1-300
python3 .gpu/apply_best.py /tmp/http/mix_steps.json evalpipe/kernels/hyper.py | tee $L/apply_best.log
grep -n "^DECODE_MIX" evalpipe/kernels/hyper.py; pack
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
timeout 130 $P tests/engine/test_cuda_graphs.py tests/engine/test_engine_deterministic.py tests/engine/test_padded_groups.py > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"; tail -n 2 $L/gpu_exactness.log
timeout 50 $P tests/engine/test_prefix_cache.py -k cuda > $L/prefix_cache_cuda.log 2>&1; echo "prefix rc $? $(( $(date +%s)-S ))s"; tail -n 1 $L/prefix_cache_cuda.log; pack
if [ $(left) -gt 140 ]; then
  timeout $(( $(left) - 10 )) python3 .gpu/served_probe.py --out /tmp/http --data-dir /tmp/data --clients 1,4 > $L/served_probe.log 2>&1; echo "served rc $? $(( $(date +%s)-S ))s"
  grep -v "^{" $L/served_probe.log | cut -c1-330 | tail -n 12
  grep "aggregate\|wall_s" $L/served_probe.log | cut -c1-250; pack
fi
if [ $(left) -gt 70 ]; then
  timeout $(( $(left) - 5 )) python3 .gpu/gsm8k_probe.py /tmp/http /tmp/data --runs 1 --no-profile > $L/gsm8k_probe.log 2>&1; echo "gsm rc $? $(( $(date +%s)-S ))s"
  grep -A 8 "== run" $L/gsm8k_probe.log | cut -c1-250
fi
echo "done at $(( $(date +%s)-S ))s"
