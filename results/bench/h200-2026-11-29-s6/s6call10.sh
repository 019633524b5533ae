#!/bin/bash
export PYTHONPATH=.
date -u
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 .dev/s6/ab3.py 5 > $OUT/ab3_gpu0.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python3 .dev/s6/ab3.py 5 > $OUT/ab3_gpu1.log 2>&1
wait; date -u
cat $OUT/ab3_gpu0.log; cat $OUT/ab3_gpu1.log
