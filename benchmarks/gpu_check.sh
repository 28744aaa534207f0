#!/usr/bin/env bash
# Issue 8's GPU work in one call on the GPU machine: install the carried wheels (if any), then run the named stages
# (default: all), each logged to $OUT/<stage>.log with its tail printed, and exit non-zero if any stage failed.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh [stage ...]
#
# Stages:
#   step_kernels  the graph step's fused kernels at production shapes vs their references (benchmarks/kernels/step_*_gpu.py)
#   graph_tests   tests/engine/test_cuda_graphs.py on CUDA (captured replays equal the eager runner; float32 tiny model)
#   spec          benchmarks/engine/spec_gpu_check.py (block speculation through the captured fused verify step is lossless)
#   serving       benchmarks/serving/gpu_serving.py, config v4-top2 (the issue's table; GPU_SERVING_ARGS adds flags)
#   serving_top6  benchmarks/serving/gpu_serving.py --config v4-top6
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { echo "wheel install failed"; tail -5 "$OUT/pip.log"; }
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(step_kernels graph_tests spec serving)
fail=0

stage() {  # stage NAME CMD...: run, log, print the tail and the status
  local name=$1; shift
  local t0=$SECONDS
  echo "=== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n "${TAIL:-30}" "$OUT/$name.log"
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  [ $rc -eq 0 ] || fail=1
}

for s in "${stages[@]}"; do
  case $s in
    step_kernels)
      for f in benchmarks/kernels/step_*_gpu.py; do stage "$(basename "$f" .py)" python3 -m "benchmarks.kernels.$(basename "$f" .py)"; done ;;
    graph_tests) stage graph_tests python3 -m pytest -q -x -p no:cacheprovider tests/engine/test_cuda_graphs.py ;;
    spec) stage spec python3 -m benchmarks.engine.spec_gpu_check --new-tokens 32 ;;
    serving) TAIL=40 stage serving python3 -m benchmarks.serving.gpu_serving --out "$OUT" ${GPU_SERVING_ARGS:-} ;;
    serving_top6) TAIL=40 stage serving_top6 python3 -m benchmarks.serving.gpu_serving --config v4-top6 --out "$OUT" \
                    ${GPU_SERVING_ARGS:-} ;;
    *) echo "unknown stage $s"; fail=1 ;;
  esac
done
exit $fail
