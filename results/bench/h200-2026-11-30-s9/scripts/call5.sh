python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/call5
date -u
timeout 250 python3 -m pytest -q -m gpu -n 8 --timeout=240 -p no:cacheprovider -p no:benchmark tests/ > $OUT/call5/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/call5/gputests.log; grep -E "^FAILED|^ERROR" $OUT/call5/gputests.log | head
