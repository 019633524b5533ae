#!/bin/bash
# Session 8, device call 9: op forward hd128 with 4 vs 1 query tiles per program, 12 interleaved rounds, per-round ratios.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 280 python3 .dev/s8/ab_q_many.py $OUT 12 > $OUT/ab_q_many_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
tail -n 30 $OUT/ab_q_many_stdout.log
