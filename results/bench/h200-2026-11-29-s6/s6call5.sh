#!/bin/bash
# Session 6, call 5: the committed code (host-built TMA descriptors). Full benchmark, bars, model step, GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
P="sigmoid-triton cudnn flash eager-sigmoid sigmoid-triton-exact flex sigmoid-triton-tma-lookahead"
(CUDA_VISIBLE_DEVICES=0 timeout 170 python3 kernels/bench_attention.py --head-dims 64 --providers $P --out $OUT/bench64 > $OUT/bench64.log 2>&1; echo "bench64 rc=$? $(date -u +%T)") &
CUDA_VISIBLE_DEVICES=1 timeout 170 python3 kernels/bench_attention.py --head-dims 128 --providers $P --out $OUT/bench128 > $OUT/bench128.log 2>&1; echo "bench128 rc=$? $(date -u +%T)"
wait
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 .dev/s6/bars.py 64 3 > $OUT/bars64.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 120 python3 .dev/s6/bars.py 128 3 > $OUT/bars128.log 2>&1
wait; echo "bars $(date -u +%T)"
CUDA_VISIBLE_DEVICES=1 timeout 90 python3 experiments/bench_model.py --steps 12 > $OUT/bench_model.log 2>&1; echo "bench_model rc=$? $(date -u +%T)"
CUDA_VISIBLE_DEVICES=1 timeout 90 python3 kernels/bench_attention.py --model-step --out $OUT/model > $OUT/model_step.log 2>&1; echo "model_step rc=$? $(date -u +%T)"
timeout 130 python3 -m pytest -q -m gpu -n 8 --timeout=120 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
tail -4 $OUT/bench_model.log; tail -6 $OUT/model_step.log
grep -E " (0.00|0.25) " $OUT/bars64.log $OUT/bars128.log | cut -c1-90
grep -E "sigmoid-triton |sigmoid-triton-tma-lookahead|cudnn " $OUT/bench128.log $OUT/bench64.log | grep -E "T= (1024|2048)" | cut -c1-110
