#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/new && cp kernels/sigmoid_attention.py kernels/triton_support.py kernels/sweep_configs.py /tmp/new/
timeout 150 python3 .dev/bardiag.py 3 > $OUT/bardiag_new1.log 2>&1; echo "new1 rc=$? $(date -u +%T)"
cp .dev/head/sigmoid_attention.py .dev/head/triton_support.py kernels/
timeout 150 python3 .dev/bardiag.py 3 > $OUT/bardiag_head.log 2>&1; echo "head rc=$? $(date -u +%T)"
cp /tmp/new/*.py kernels/
timeout 150 python3 .dev/bardiag.py 3 > $OUT/bardiag_new2.log 2>&1; echo "new2 rc=$? $(date -u +%T)"
for f in new1 head new2; do echo "== $f"; grep -v Warn $OUT/bardiag_$f.log | grep -v "done$" | grep -v "^host" | head -60; done
timeout 200 python3 -m pytest -q -m gpu -n 8 --timeout=190 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -2 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
