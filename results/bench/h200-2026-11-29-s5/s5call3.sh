#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u; nvidia-smi --query-gpu=name --format=csv,noheader; git log --oneline | head -1
timeout 300 python3 .dev/bardiag.py 3 > $OUT/bardiag.log 2>&1; echo "bardiag rc=$? $(date -u +%T)"
cat $OUT/bardiag.log | grep -v Warn
(timeout 240 python3 -m pytest -q -m gpu -n 8 --timeout=200 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)")
tail -2 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
