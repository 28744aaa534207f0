#!/bin/bash
# Issue 44: the spec-on arms of the whole arith lane on CUDA (greedy and T=1), against the off arms of call 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
R=/tmp/on; mkdir -p $R; p=18433
python3 -m evalpipe.cli serve --device cuda --speculative block --port $p > $R/serve-on.log 2>&1 &
s=$!
for i in $(seq 1 120); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$p/health_generate', timeout=20)" 2>/dev/null && break; sleep 1; done
for arm in on t1-on; do
  t=(); [ $arm = t1-on ] && t=(--temperature 1)
  start=$(date +%s)
  timeout 240 python3 -m evalpipe.cli run arith --base-url http://127.0.0.1:$p/v1 --out $R/$arm --arm $arm --no-progress \
    --concurrency 64 "${t[@]}" > $R/run-$arm.log 2>&1
  echo "$arm rc $? in $(( $(date +%s) - start )) s"; tail -4 $R/run-$arm.log
done
kill $s; wait
tar czf $OUT/on.tgz -C /tmp on
