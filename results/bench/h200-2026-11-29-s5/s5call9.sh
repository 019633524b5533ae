#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
date -u
timeout 220 python3 .dev/fused_bwd.py $OUT 2>&1 | grep -v Warn | tail -30
date -u
