#!/bin/bash
# Session 7, call 5: GPU tests of the final code; the benchmark grid at head dim 128 for the op
# (A_REGS with TMA at hd 128), its lever providers and cuDNN / flash.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 250 python3 -m pytest -q -m gpu -n 8 --timeout=240 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests_final.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/gputests_final.log; grep -E "^FAILED|^ERROR" $OUT/gputests_final.log | head
timeout 300 python3 kernels/bench_attention.py --head-dims 128 \
  --providers sigmoid-triton cudnn flash sigmoid-triton-tma-lookahead sigmoid-triton-tma-lookahead-aregs \
  --out $OUT/bench128 > $OUT/bench128.log 2>&1; echo "bench rc=$? $(date -u +%T)"
tail -n 25 $OUT/bench128.log
