#!/bin/bash
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
S=$(date +%s)
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader; ls /tmp/v4-top2 | head -3
rm -rf /tmp/base && mkdir /tmp/base && cp -r evalpipe benchmarks tests /tmp/base && (cd /tmp/base && patch -R -p1 -s < $OLDPWD/.gpu/attn.diff) || exit 1
AB="python3 $PWD/.gpu/moe_ab.py /tmp $PWD/.gpu/step_moe_rows.log"
(cd /tmp/base && PYTHONPATH=/tmp/site:/tmp/base timeout 100 $AB mm base > $OUT/ab_base.log 2>&1); echo "base rc $? $(( $(date +%s)-S ))s"
timeout 70 $AB mm new > $OUT/ab_new_mm.log 2>&1; echo "new rc $? $(( $(date +%s)-S ))s"
grep -h -E "^(base|new) batch" $OUT/ab_base.log $OUT/ab_new_mm.log
