#!/bin/bash
# Session 7, call 2: GPU tests with A_REGS (forward at hd 128 in the op; every lever set tested),
# then the op with / without A_REGS and cuDNN, one process, 5 interleaved rounds.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 280 python3 -m pytest -q -m gpu -n 8 --timeout=270 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -2 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
timeout 280 python3 .dev/s7/ab_aregs.py 5 > $OUT/ab_aregs.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -n 60 $OUT/ab_aregs.log
