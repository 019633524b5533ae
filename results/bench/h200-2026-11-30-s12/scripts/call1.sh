# Session 12, call 1 (one H200): A/B of the concurrent backward (dQ on a side stream), then the
# full GPU suite on the working tree (BWD_CONCURRENT on, persistent_grid).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 170 python3 .dev/s12/ab_bwd_stream.py $OUT/r 5 > $OUT/r/ab_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
cat $OUT/r/ab_full.log | grep -v "^\s*$" | tail -40
timeout 90 python3 .dev/s12/planted_nojoin.py > $OUT/r/planted.log 2>&1; echo "planted rc=$? (0 = caught)"; grep -E "passed|failed" $OUT/r/planted.log | tail -2
timeout 270 python3 -m pytest -q -m gpu -n 8 --timeout=200 -p no:cacheprovider -p no:benchmark tests/ > $OUT/r/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests.log | head
tar czf $OUT/call1.tgz -C $OUT r && rm -rf $OUT/r
