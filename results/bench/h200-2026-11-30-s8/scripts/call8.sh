#!/bin/bash
# Session 8, device call 8: production Q_TILES=4 vs its range() twin vs k_group.py, direct launches.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 250 python3 .dev/s8/q4_variants.py $OUT 7 > $OUT/q4_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
tail -n 20 $OUT/q4_stdout.log
