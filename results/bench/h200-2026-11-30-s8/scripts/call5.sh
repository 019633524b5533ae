#!/bin/bash
# Session 8, device call 5: Q_TILES query tiles per program (descriptors reused) vs the committed forward.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 500 python3 .dev/s8/group_ab.py $OUT 7 > $OUT/group_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
tail -n 80 $OUT/group_stdout.log
