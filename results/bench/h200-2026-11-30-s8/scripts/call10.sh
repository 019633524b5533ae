#!/bin/bash
# Session 8, device call 10: per-tile clock probes, 1 vs 4 query tiles per program.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 250 python3 .dev/s8/probe_run2.py $OUT > $OUT/probe2_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
tail -n 20 $OUT/probe2_stdout.log
