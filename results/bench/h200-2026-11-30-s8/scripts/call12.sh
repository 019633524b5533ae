#!/bin/bash
# Session 8, device call 12: SM clock and power under the op and cuDNN (nvidia-smi every 50 ms).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,power.default_limit --format=csv
timeout 200 python3 .dev/s8/clocks.py $OUT > $OUT/clocks_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
tail -n 30 $OUT/clocks_stdout.log; sort $OUT/smi.csv | awk -F, '{print $5}' | sort | uniq -c | head
