#!/bin/bash
# --deterministic with the CUDA-graph step on slab_matmul: the identity arms on all 1,314 GSM8K prompts (cache on/off,
# spec off vs block ngram, C64 vs C1 on 128) as benchmarks/README.md's deterministic_gpu row runs them.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card.txt
git log -1 --format=%H > $OUT/commit.txt 2>/dev/null
timeout 530 python3 -m benchmarks.serving.deterministic_gpu --data-dir /tmp/data --prompts 1314 --c1-prompts 128 --modes deterministic --drafters ngram --out $OUT/det1314 > $OUT/det1314.log 2>&1; echo "rc $?"
tail -14 $OUT/det1314.log
