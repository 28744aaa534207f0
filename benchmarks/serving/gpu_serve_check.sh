#!/usr/bin/env bash
# `evalpipe serve --device cuda --dtype bfloat16` end to end on the GPU machine (issue 8): start the server with
# speculation + simulated acceptance and CUDA graphs, wait for /health_generate, send one completion, print
# /get_server_info's engine settings, stop the server. Needs fastapi + uvicorn there; says so and exits 0 if absent.
#   PYTHONPATH=. bash benchmarks/serving/gpu_serve_check.sh [PORT] [--fused on|off]
set -u
PORT=${1:-30111}; shift || true
if ! python -c "import fastapi, uvicorn" 2>/dev/null; then
  echo "gpu_serve_check: fastapi/uvicorn not installed here; skipped"; exit 0
fi
LOG=${OUT:-/tmp}/serve_check.log
python -m evalpipe.cli serve --device cuda --dtype bfloat16 --speculative block --block-size 5 \
  --simulate-acc-len 5.5 --max-batch 4 --port "$PORT" "$@" >"$LOG" 2>&1 &
PID=$!
for _ in $(seq 120); do
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health_generate")
  [ "$code" = 200 ] && break
  kill -0 $PID 2>/dev/null || break
  sleep 1
done
echo "health_generate: $code"
curl -s "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' \
  -d '{"model": "evalpipe-tiny-dsv4", "prompt": "Hello", "max_tokens": 24, "temperature": 0, "return_token_ids": true}'
echo
curl -s "http://127.0.0.1:$PORT/get_server_info" | python -c "
import json, sys
d = json.load(sys.stdin)
print(json.dumps({'device': d.get('device'), 'dtype': d.get('dtype'),
                  'cuda_graphs': d.get('runner', {}).get('cuda_graphs'),
                  'fused': d.get('server_args', {}).get('fused'), 'speculative': d.get('speculative')}))"
kill $PID; wait $PID 2>/dev/null
tail -5 "$LOG"
