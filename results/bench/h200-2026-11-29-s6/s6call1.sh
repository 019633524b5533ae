#!/bin/bash
# Session 6, call 1: the 4-warp configs that fit two or more CTAs per SM at head dim 128 (never swept).
export PYTHONPATH=.
date -u; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 560 python3 kernels/sweep_configs.py --workers 24 --repeat 3 --levers 00 10 --fwd-levers 11 10 \
  --configs fwd=128x64x8x3,128x64x4x3,64x64x4x2,64x32x4x3,64x32x4x4,64x64x4x3,64x128x4x2 \
            dq=128x64x8x3,64x64x4x3,64x64x4x2,64x32x4x3,64x32x4x4,128x64x4x2,128x32x4x3 \
            dkdv=64x128x8x3,64x64x4x3,64x64x4x2,32x64x4x3,32x64x4x4,32x128x4x2,32x128x4x3 \
  --out $OUT/sweep3 > $OUT/sweep3.log 2>&1; echo "rc=$? $(date -u +%T)"
cat $OUT/sweep3/sweep_summary.txt
grep -i "fail" $OUT/sweep3.log | head -5
