#!/bin/bash
# Call 2: `evalpipe serve` + `evalpipe bench` C64/C16 + `evalpipe run gsm8k` 1,314 at C64 on this tree (twice), then
# the default C64 decode step with merge/mix as GEMM tiles at 64 rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card2.txt
S=$(date +%s)
mkdir -p /tmp/http
timeout 330 python3 .gpu/http_ab.py --out /tmp/http --base . --order new,new --data-dir /tmp/data > $OUT/http_ab.log 2>&1; echo "http rc $? $(( $(date +%s)-S ))s"
cp /tmp/http/*.log /tmp/http/http_ab.json $OUT/ 2>/dev/null
tail -n 4 $OUT/http_ab.log
timeout $(( 585 - $(date +%s) + S )) python3 .gpu/hyper_dot_profile.py $OUT 32,64,4 16,64,4 > $OUT/hyper_dot_profile.log 2>&1; echo "hyper_dot_profile rc $? $(( $(date +%s)-S ))s"
grep "^arm" $OUT/hyper_dot_profile.log
