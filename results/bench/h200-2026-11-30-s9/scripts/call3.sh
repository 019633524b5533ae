python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/call3
date -u
timeout 250 python3 -m pytest -q -m gpu -n 8 --timeout=240 -p no:cacheprovider -p no:benchmark tests/ > $OUT/call3/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/call3/gputests.log; grep -E "^FAILED|^ERROR" $OUT/call3/gputests.log | head
timeout 300 python3 .dev/s9/ab9.py $OUT/call3 5 > $OUT/call3/ab9_stdout.log 2>&1; echo "ab rc=$? $(date -u +%T)"
grep -v "^_" $OUT/call3/ab9_stdout.log | tail -n 90
