#!/bin/bash
# Call 8 (2026-12-07): call 7's parts in the order the card favours (H200, whose C64 target the MoE shapes are for:
# the shapes first; else the served GSM8K first), within B seconds (default 588). MoE launch shapes at C64 in
# process (.gpu/moe_ab64.py); the best written into MM_LARGE when its replay beats base's by 8 us or more
# (.gpu/pick_shape.py) and time is left for the CUDA exactness tests on that tree, which then run; the served GSM8K
# job with --prefill-delay-factor 0 and 1 (.gpu/gsm_delay.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card8.txt
S=$(date +%s)
left() { echo $(( ${B:-588} - $(date +%s) + S )); }
L=/tmp/logs8; mkdir -p $L
pack() { find $L -name "*.safetensors" -delete; tar czf $OUT/call8_logs.tgz -C /tmp logs8; }
trap pack EXIT
P="python3 -m pytest -q -o addopts= -p no:cacheprovider -rs"
shapes() {
  timeout 170 python3 .gpu/moe_ab64.py $L > $L/moe_ab64.log 2>&1; echo "moe_ab rc $? $(( $(date +%s)-S ))s"
  grep -v Writing $L/moe_ab64.log | cut -c1-200
  cp evalpipe/kernels/moe.py /tmp/moe_before.py
  if [ $(left) -gt 215 ]; then
    python3 .gpu/pick_shape.py $L/moe_ab64.json evalpipe/kernels/moe.py 2>&1 | tee $L/pick.log
  else
    cp evalpipe/kernels/moe.py /tmp/moe_dry.py; python3 .gpu/pick_shape.py $L/moe_ab64.json /tmp/moe_dry.py 2>&1 | tee $L/pick.log; echo "(too little time left to test a patch: MM_LARGE left as it is)"
  fi
  diff -u /tmp/moe_before.py evalpipe/kernels/moe.py > $L/moe_patch.diff && echo "MM_LARGE unchanged" || cat $L/moe_patch.diff
  if [ -s $L/moe_patch.diff ]; then
    timeout 140 $P tests/engine/test_engine_deterministic.py tests/engine/test_cuda_graphs.py > $L/gpu_exactness.log 2>&1; echo "pytest rc $? $(( $(date +%s)-S ))s"
    tail -n 3 $L/gpu_exactness.log
    timeout 60 $P tests/engine/test_prefix_cache.py -k cuda > $L/prefix_cache_cuda.log 2>&1; echo "prefix pytest rc $? $(( $(date +%s)-S ))s"
    tail -n 3 $L/prefix_cache_cuda.log
  fi
}
served() {
  [ $(left) -gt 100 ] || { echo "served GSM8K: too little time left"; return; }
  timeout $(( $(left) > 130 ? 130 : $(left) - 3 )) python3 .gpu/gsm_delay.py --out $L --data-dir /tmp/data --factors 0,1 > $L/gsm_delay.log 2>&1; echo "delay rc $? $(( $(date +%s)-S ))s"
  tail -n 4 $L/gsm_delay.log
}
if grep -q H200 $OUT/card8.txt; then shapes; served; else served; [ $(left) -gt 180 ] && shapes; fi
echo "done at $(( $(date +%s)-S ))s"
