# Session 11, call 4 (one H200): the forward's last round split by keys. GPU tests that touch it,
# then ab_tail.py (new vs old dense forward, same config; op; cuDNN), 7 rounds.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u
timeout 200 python3 -m pytest -q -m gpu -n 8 --timeout=190 -p no:cacheprovider -p no:benchmark -k "tail or dense or matches_reference or compile or straight or specialisation or max_abs or bias_scale" tests/test_kernels.py > $OUT/r/gputests_tail.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests_tail.log; grep -E "^FAILED|^ERROR|Error" $OUT/r/gputests_tail.log | head
timeout 300 python3 .dev/s11/ab_tail.py $OUT/r 7 > $OUT/r/ab_tail_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -30 $OUT/r/ab_tail_full.log
tar czf $OUT/call4.tgz -C $OUT r && rm -rf $OUT/r
