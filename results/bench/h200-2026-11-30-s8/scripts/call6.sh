#!/bin/bash
# Session 8, device call 6: GPU tests of the Q_TILES code, then the op with 4 vs 1 query tiles per program vs cuDNN.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 280 python3 -m pytest -q -m gpu -n 8 --timeout=260 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
timeout 290 python3 .dev/s8/ab_q.py $OUT 5 > $OUT/ab_q_stdout.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -n 40 $OUT/ab_q_stdout.log
