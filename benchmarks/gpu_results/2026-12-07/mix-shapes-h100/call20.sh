#!/bin/bash
# Call 20 (2026-12-07, stop 62): one served boot (bench C64 with 1 and 4 client processes, GSM8K 1,314 at C64 with
# the engine log's decode-only and prompt step times), then the merge/mix shape sweep of the tree's per-row kernel
# and the GEMM-tile kernel at the C64 decode step's 64 rows: 8 processes first compile the shapes side by side (their
# timings discarded), one times the chain for each shape, then the C64 step for the tree's and the best three.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:.
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv | tee $OUT/card20.txt
S=$(date +%s)
left() { echo $(( ${B:-580} - $(date +%s) + S )); }
L=/tmp/logs20; mkdir -p $L /tmp/http /tmp/mix
pack() { cp /tmp/http/*.log /tmp/http/*.json /tmp/mix/*.json $L/ 2>/dev/null; tar czf $OUT/call20_logs.tgz --exclude='*.safetensors' -C /tmp logs20; }
trap pack EXIT
# the precompile: 8 processes side by side, each every 8th shape, before anything is timed
for k in 0 1 2 3 4 5 6 7; do timeout 150 python3 .gpu/mix_sweep.py /tmp/mix --part $k/8 --budget 120 > $L/precompile$k.log 2>&1 & done
wait; echo "precompile done $(( $(date +%s)-S ))s"; grep -c shape $L/precompile*.log | tr '\n' ' '; echo
timeout 260 python3 .gpu/served_probe.py --out /tmp/http --data-dir /tmp/data --clients 1,4 > $L/served_probe.log 2>&1; echo "served rc $? $(( $(date +%s)-S ))s"
grep -v "^{" $L/served_probe.log | cut -c1-330 | tail -n 12
grep "aggregate\|wall_s" $L/served_probe.log | cut -c1-250; pack
timeout $(( $(left) - 10 )) python3 .gpu/mix_sweep.py /tmp/mix --budget 120 > $L/mix_sweep.log 2>&1; echo "sweep rc $? $(( $(date +%s)-S ))s"
grep "base chain\|step \|budget\|C1 " $L/mix_sweep.log | cut -c1-300
grep '"shape"' $L/mix_sweep.log | sort -t: -k3 -n | head -8 | cut -c1-160
echo "done at $(( $(date +%s)-S ))s"
