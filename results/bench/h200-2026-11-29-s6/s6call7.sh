#!/bin/bash
export PYTHONPATH=.
date -u
CUDA_VISIBLE_DEVICES=0 timeout 250 python3 .dev/s6/ab.py 64 5 > $OUT/ab64.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 250 python3 .dev/s6/ab.py 128 5 > $OUT/ab128.log 2>&1
wait; date -u
tail -n 22 $OUT/ab128.log; tail -n 22 $OUT/ab64.log
