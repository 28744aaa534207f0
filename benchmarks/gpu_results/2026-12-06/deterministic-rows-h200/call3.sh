#!/bin/bash
# Call 3: `evalpipe serve` + `evalpipe bench` C64/C16 + `evalpipe run gsm8k` 1,314 at C64 on this tree.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
mkdir -p /tmp/data/gsm8k && gunzip -c .gpu/data/gsm8k/test.jsonl.gz > /tmp/data/gsm8k/test.jsonl
export EVALPIPE_DATA_DIR=/tmp/data
nvidia-smi --query-gpu=name,driver_version --format=csv | tee $OUT/card3.txt
python3 -c "import openai, fastapi, uvicorn; print('openai', openai.__version__)" || exit 1
S=$(date +%s)
mkdir -p /tmp/http
timeout 330 python3 .gpu/http_ab.py --out /tmp/http --base . --order new,new --data-dir /tmp/data > $OUT/http_ab.log 2>&1; echo "http rc $? $(( $(date +%s)-S ))s"
cp /tmp/http/*.log /tmp/http/http_ab.json $OUT/ 2>/dev/null
tail -n 4 $OUT/http_ab.log
