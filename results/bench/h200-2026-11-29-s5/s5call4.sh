#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python3 .dev/bardiag.py 3 > $OUT/bardiag_new.log 2>&1; echo "new rc=$? $(date -u +%T)"
mkdir -p /tmp/new && cp kernels/sigmoid_attention.py kernels/triton_support.py /tmp/new/
cp .dev/head/*.py kernels/
timeout 200 python3 .dev/bardiag.py 3 > $OUT/bardiag_head.log 2>&1; echo "head rc=$? $(date -u +%T)"
cp /tmp/new/*.py kernels/
echo "== new"; grep -v Warn $OUT/bardiag_new.log | grep -v done
echo "== head"; grep -v Warn $OUT/bardiag_head.log | grep -v done
