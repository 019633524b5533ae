#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline | head -1
timeout 200 python3 experiments/bench_model.py --steps 12 > $OUT/bench_model.log 2>&1; echo "bench_model rc=$? $(date -u +%T)"
tail -14 $OUT/bench_model.log
timeout 200 python3 kernels/bench_attention.py --model-step --out $OUT/model_step > $OUT/model_step.log 2>&1; echo "model_step rc=$? $(date -u +%T)"
tail -8 $OUT/model_step.log; cat $OUT/model_step/model_step.md 2>/dev/null
