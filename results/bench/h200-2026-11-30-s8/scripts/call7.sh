#!/bin/bash
# Session 8, device call 7: the op with 4 vs 1 query tiles, direct launches at the op's config too, and the autotuner's choices.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
ONLY_FWD=1 timeout 290 python3 .dev/s8/ab_q.py $OUT 6 > $OUT/ab_q_fwd_stdout.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -n 40 $OUT/ab_q_fwd_stdout.log
