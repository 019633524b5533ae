# Session 11, call 9 (one H200): persistent_grid in the op: the dense-path GPU tests, then
# ab_grid2.py (the op's launcher on 132 programs vs persistent_grid's 128), 15 rounds.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u
timeout 110 python3 -m pytest -q -m gpu -n 8 --timeout=100 -p no:cacheprovider -p no:benchmark -k "dense or persistent_grid or fullgraph" tests/test_kernels.py > $OUT/r/gputests_grid.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests_grid.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests_grid.log | head
timeout 90 python3 .dev/s11/ab_grid2.py $OUT/r 15 > $OUT/r/ab_grid2_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -12 $OUT/r/ab_grid2_full.log
tar czf $OUT/call9.tgz -C $OUT r && rm -rf $OUT/r
