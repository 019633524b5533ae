#!/bin/bash
export PYTHONPATH=.:.dev/s6
date -u
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 .dev/s6/hostdesc.py 64 > $OUT/hostdesc64.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 400 python3 .dev/s6/hostdesc.py 128 > $OUT/hostdesc128.log 2>&1
wait; date -u
cat $OUT/hostdesc128.log $OUT/hostdesc64.log | grep -v "^\s*$" | tail -80
