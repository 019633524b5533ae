#!/bin/bash
# Session 7, call 8: GPU tests of the final code (dQ kernel on TMA in the op from T = 4096).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 250 python3 -m pytest -q -m gpu -n 8 --timeout=240 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests_final.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/gputests_final.log; grep -E "^FAILED|^ERROR" $OUT/gputests_final.log | head
timeout 200 python3 .dev/s7/ab_final.py 5 > $OUT/ab_final.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -n 26 $OUT/ab_final.log
timeout 150 python3 kernels/bench_attention.py --model-step --out $OUT/model_step > $OUT/model_step.log 2>&1; echo "model step rc=$? $(date -u +%T)"
tail -n 8 $OUT/model_step.log
