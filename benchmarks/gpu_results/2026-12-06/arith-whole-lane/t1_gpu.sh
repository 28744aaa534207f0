#!/bin/bash
# Issue 44's whole-lane rows on CUDA: greedy arith 1200, spec identity + accept length, T=1 spec on - off (rejection
# sampling, the default), then the same T=1 lane under --deterministic (keyed sampling + sample-verify).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a $OUT/card.txt
T=/tmp/targets
start=$(date +%s)
timeout ${TARGETS_S:-300} python3 -m benchmarks.model.default_model_targets --out $T --serve-args "--device cuda" \
  --run-args "--concurrency 64" --skip copy,retrieval,boxed,think,sgl-eval,repeat,qualify,qualify-keys,lossy,oracle \
  > $OUT/targets.log 2>&1
echo "targets rc $? in $(( $(date +%s) - start )) s"
tail -25 $OUT/targets.log

# keyed sampling: both arms --deterministic, the same --sample-seeds base
K=/tmp/keyed; mkdir -p $K
p1=18431; p2=18432
python3 -m evalpipe.cli serve --device cuda --deterministic --port $p1 > $K/serve-off.log 2>&1 &
s1=$!
python3 -m evalpipe.cli serve --device cuda --deterministic --speculative block --port $p2 > $K/serve-on.log 2>&1 &
s2=$!
for p in $p1 $p2; do
  for i in $(seq 1 120); do python3 -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$p/health_generate', timeout=20)" 2>/dev/null && break; sleep 1; done
done
start=$(date +%s)
for arm in off on; do
  p=$p1; [ $arm = on ] && p=$p2
  timeout 100 python3 -m evalpipe.cli run arith --base-url http://127.0.0.1:$p/v1 --out $K/runs --arm keyed-$arm \
    --temperature 1 --sample-seeds 44 --concurrency 64 --no-progress > $K/run-$arm.log 2>&1
  echo "keyed $arm rc $?"; tail -3 $K/run-$arm.log
done
python3 -m evalpipe.cli compare $K/runs/arith/keyed-off-* $K/runs/arith/keyed-on-* --out $K/compare --intended '*spec*' \
  > $K/compare.log 2>&1
echo "keyed compare rc $? in $(( $(date +%s) - start )) s"; tail -30 $K/compare.log
kill $s1 $s2; wait
tar czf $OUT/targets.tgz -C /tmp targets keyed 2>/dev/null
ls -la $OUT
