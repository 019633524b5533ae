#!/bin/bash
# Session 6, call 8: GPU tests of the final code (acb2de2 kernels, the whole_tiles test shape added).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 200 python3 -m pytest -q -m gpu -n 8 --timeout=190 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests_final.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -2 $OUT/gputests_final.log; grep -E "^FAILED|^ERROR" $OUT/gputests_final.log | head
