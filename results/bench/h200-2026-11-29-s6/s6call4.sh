#!/bin/bash
# Session 6, call 4: host-built TMA descriptors. GPU tests (GPU 0) and the kernel sweep (GPU 1), then the bars.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
(CUDA_VISIBLE_DEVICES=0 timeout 300 python3 -m pytest -q -m gpu -n 8 --timeout=280 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)") &
CUDA_VISIBLE_DEVICES=1 timeout 300 python3 kernels/sweep_configs.py --workers 12 --repeat 3 --levers 00 10 --fwd-levers 11 \
  --configs fwd=128x64x8x3,128x64x8x4,128x64x4x3,64x64x4x2 dq=128x64x8x3,128x64x8x4,64x64x4x3 dkdv=64x128x8x3,64x64x4x3,64x64x4x2 \
  --out $OUT/sweep4 > $OUT/sweep4.log 2>&1; echo "sweep rc=$? $(date -u +%T)"
wait
tail -2 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
cat $OUT/sweep4/sweep_summary.txt
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 .dev/s6/bars.py 64 3 > $OUT/bars64.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 280 python3 .dev/s6/bars.py 128 3 > $OUT/bars128.log 2>&1
wait; date -u
tail -n 32 $OUT/bars64.log; tail -n 32 $OUT/bars128.log
