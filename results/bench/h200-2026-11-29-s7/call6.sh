#!/bin/bash
# Session 7, call 6: the forward's key loop unrolled by two (no register copy of the look-ahead tile).
export PYTHONPATH=.
timeout 400 python3 .dev/s7/pairs_ab.py 5 2>&1 | tee $OUT/pairs_ab.log | tail -45
