#!/bin/bash
# Issues 46 and 44 on CUDA, all servers --deterministic (keyed sampling + sample-verify), the arms run side by side:
# phase 1: chat-arith-boxed-think-x16 (480 at T=1) on spec off, block (layerskip:4), ngram, one --sample-seeds base;
# phase 2: arith (1200 at T=1) on off and block; arith 16 items at C1 and then C64 on the ngram server.
[ -n "$SKIP_PIP" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt; R=/tmp/seeded; rm -rf $R
R=/tmp/seeded; mkdir -p $R
declare -A PORT=([off]=18441 [block]=18442 [ngram]=18443)
declare -A ARGS=([off]="" [block]="--speculative block" [ngram]="--speculative block --drafter ngram")
for a in off block ngram; do
  python3 -m evalpipe.cli serve --device ${DEV:-cuda} --deterministic ${ARGS[$a]} --port ${PORT[$a]} > $R/serve-$a.log 2>&1 &
done
for a in off block ngram; do
  for i in $(seq 1 150); do python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:${PORT[$a]}/health_generate', timeout=20)" 2>/dev/null && break; sleep 1; done
done
run() {  # arm-name port lane timeout extra...
  local name=$1 port=$2 lane=$3 t=$4; shift 4
  local s=$(date +%s)
  timeout $t python3 -m evalpipe.cli run $lane --base-url http://127.0.0.1:$port/v1 --out $R/runs --arm $name --no-progress "$@" $EXTRA \
    > $R/run-$name.log 2>&1
  echo "$name rc $? in $(( $(date +%s) - s )) s: $(grep -h '^wall' $R/run-$name.log)"
}
for a in off block ngram; do run x16-$a ${PORT[$a]} chat-arith-boxed-think-x16 200 --sample-seeds 46 & done
wait $(jobs -p | tail -3)
run t1-keyed-off ${PORT[off]} arith 200 --temperature 1 --sample-seeds 44 --concurrency 64 &
run t1-keyed-block ${PORT[block]} arith 200 --temperature 1 --sample-seeds 44 --concurrency 64 &
( run c1-ngram ${PORT[ngram]} arith 150 --temperature 1 --sample-seeds 44 --num-examples 16 --concurrency 1
  run c64-ngram ${PORT[ngram]} arith 60 --temperature 1 --sample-seeds 44 --num-examples 16 --concurrency 64 ) &
wait $(jobs -p | tail -3)
for a in off block ngram; do
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:${PORT[$a]}/get_server_info').read().decode())" > $R/info-$a.json
done
kill %1 %2 %3 2>/dev/null; sleep 2
tar czf $OUT/seeded.tgz -C /tmp seeded
ls -la $OUT
