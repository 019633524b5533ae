#!/bin/bash
# Session 7, call 7: the op's backward with the dQ kernel on TMA vs as committed, and cuDNN.
export PYTHONPATH=.
timeout 400 python3 .dev/s7/ab_tmadq.py 5 > $OUT/ab_tmadq.log 2>&1; echo "rc=$?"
tail -n 32 $OUT/ab_tmadq.log
