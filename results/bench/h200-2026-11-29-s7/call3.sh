#!/bin/bash
# Session 7, call 3: the hd-128 forward with q in registers, wider key tiles and more stages
# (registers freed by dropping the lookahead; shared memory freed by q leaving it), kernel alone.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
python3 kernels/sweep_configs.py --head-dims 128 --seq-lens 4096 8192 16384 --kinds fwd \
  --fwd-levers 110 111 101 100 \
  --configs fwd=128x64x8x3,128x64x8x4,128x64x8x2,128x128x8x2,128x128x8x3,128x32x8x4,64x128x4x3 \
  --repeat 5 --workers 16 --out $OUT/sweep 2>&1 | grep -v "^warm fail" | tail -40
