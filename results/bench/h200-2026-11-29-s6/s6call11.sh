#!/bin/bash
# Session 6, call 11: sweep_configs.py on one visible GPU times the head dims one after the other.
export PYTHONPATH=.
date -u
timeout 200 python3 kernels/sweep_configs.py --workers 4 --kinds fwd --configs fwd=128x64x8x3 --seq-lens 4096 8192 --out $OUT/sweep_1gpu > $OUT/sweep_1gpu.log 2>&1; echo "rc=$? $(date -u +%T)"
cat $OUT/sweep_1gpu/sweep_summary.txt
