#!/bin/bash
# the GSM8K job's engine half in process (1,314 five-shot prompts, C64, prefix cache on): the tree before the two
# kernel changes (attention reversed, DOWN_ROWS_FROM None), then this tree
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
S=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests /tmp/base && (cd /tmp/base && patch -R -p1 -s < $OLDPWD/.gpu/attn.diff && sed -i 's/^DOWN_ROWS_FROM: int | None = 64$/DOWN_ROWS_FROM: int | None = None/' evalpipe/kernels/moe.py && grep -c "^DOWN_ROWS_FROM: int | None = None" evalpipe/kernels/moe.py) || exit 1
G="python3 $PWD/.gpu/gsm8k_engine_probe.py /tmp /tmp/data 0"
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout 75 $G > $OUT/gsm_base.log 2>&1); echo "base rc $? $(( $(date +%s)-S ))s"
timeout 70 $G > $OUT/gsm_new.log 2>&1; echo "new rc $? $(( $(date +%s)-S ))s"
grep -h -E "wall|ms/step|built" $OUT/gsm_base.log $OUT/gsm_new.log
