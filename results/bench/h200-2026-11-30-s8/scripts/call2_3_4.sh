#!/bin/bash
# Session 8, device calls 2-4: per-program timestamps in the forward (probe_run.py).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 400 python3 .dev/s8/probe_run.py $OUT > $OUT/probe_stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
tail -n 40 $OUT/probe_stdout.log
