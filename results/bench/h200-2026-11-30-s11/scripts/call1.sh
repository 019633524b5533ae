# Session 11, call 1 (one H200): the full GPU test suite on HEAD (+ the softmax lengths change),
# then persistent dense backward kernels vs one program per tile vs the op vs cuDNN (5 rounds).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u; git log --oneline | head -1
timeout 230 python3 -m pytest -q -m gpu -n 8 --timeout=200 -p no:cacheprovider -p no:benchmark tests/ > $OUT/r/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests.log | head
timeout 300 python3 .dev/s11/persist_bwd.py $OUT/r 5 > $OUT/r/persist_bwd_full.log 2>&1; echo "persist rc=$? $(date -u +%T)"
grep -v "^{" $OUT/r/persist_bwd_full.log | tail -45
cp -r .dev/s11/gen $OUT/r/ 2>/dev/null
tar czf $OUT/call1.tgz -C $OUT r && rm -rf $OUT/r
