#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 170 python3 -m pytest -q -m gpu -n 8 --timeout=160 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -2 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
