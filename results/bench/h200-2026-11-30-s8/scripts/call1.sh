#!/bin/bash
# Session 8, device call 1: persistent forward (generated from the committed kernel) vs the committed kernel, the op, cuDNN.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv
timeout 500 python3 .dev/s8/persist_ab.py $OUT 8 > $OUT/persist_ab_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
cat $OUT/persist_ab_stdout.log | tail -n 80
