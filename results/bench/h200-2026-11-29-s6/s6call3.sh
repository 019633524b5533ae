#!/bin/bash
export PYTHONPATH=.:.dev/s6
date -u
CUDA_VISIBLE_DEVICES=0 timeout 300 python3 .dev/s6/hostdesc.py 128 > $OUT/hostdesc128a.log 2>&1 &
sleep 1; CUDA_VISIBLE_DEVICES=1 timeout 300 python3 .dev/s6/hostdesc.py 128 > $OUT/hostdesc128b.log 2>&1
wait; date -u
paste -d'|' <(cut -c1-75 $OUT/hostdesc128a.log) <(cut -c36-75 $OUT/hostdesc128b.log)
