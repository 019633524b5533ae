#!/bin/bash
# Session 8, device call 11: GPU tests of the final code; the benchmark's lever providers with and without 4 query tiles.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 300 python3 -m pytest -q -m gpu -n 8 --timeout=280 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
timeout 200 python3 kernels/bench_attention.py --head-dims 128 --seq-lens 4096 16384 --paddings 0 0.25 \
   --providers sigmoid-triton sigmoid-triton-tma-lookahead-aregs sigmoid-triton-tma-lookahead-aregs-q4 cudnn \
   --out $OUT/bench128 > $OUT/bench128.log 2>&1; echo "bench rc=$? $(date -u +%T)"
tail -n 12 $OUT/bench128.log; cat $OUT/bench128/attention.md 2>/dev/null | head -20
