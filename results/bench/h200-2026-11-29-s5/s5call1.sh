#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 400 python3 .dev/persist.py $OUT/persist > $OUT/persist.log 2>&1; echo rc=$?
grep -v Warn $OUT/persist.log | tail -5
date -u
