# Session 10, call 3 (one H200): the dense backward with one set of descriptors (GPU tests of the
# dense path), then a persistent dense forward vs the op vs cuDNN (hd 128, 8 rounds).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u
timeout 200 python3 -m pytest -q -m gpu -n 4 --timeout=190 -p no:cacheprovider -p no:benchmark -k "dense or lengths_all_full or straight_launch or matches_reference" tests/test_kernels.py > $OUT/r/gputests_dense.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests_dense.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests_dense.log | head
timeout 300 python3 .dev/s10/persist_dense.py $OUT/r 8 > $OUT/r/persist_dense_full.log 2>&1; echo "persist rc=$? $(date -u +%T)"
cat $OUT/r/persist_dense_full.log | tail -30
cp -r .dev/s10/gen $OUT/r/ 2>/dev/null
tar czf $OUT/call3.tgz -C $OUT r && rm -rf $OUT/r
