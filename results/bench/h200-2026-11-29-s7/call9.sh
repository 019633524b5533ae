#!/bin/bash
# Session 7, call 9: the forward's first key tile folded into the loop: A/B vs the kernel before,
# then the GPU tests of that code.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 170 python3 .dev/s7/fold_ab.py 5 > $OUT/fold_ab.log 2>&1; echo "ab rc=$? $(date -u +%T)"
grep -v "^D=64" $OUT/fold_ab.log | tail -n 26; grep "^D=64" $OUT/fold_ab.log | grep -v "max=1" | tail -14
timeout 200 python3 -m pytest -q -m gpu -n 8 --timeout=190 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
