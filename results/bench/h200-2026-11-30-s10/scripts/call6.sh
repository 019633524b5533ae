# Session 10, call 6 (one H200), the final code: the exact mode's forward back on the general
# kernel (hd 128, unpadded, 2 rounds), then the full GPU test suite.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u
timeout 75 python3 kernels/bench_attention.py --head-dims 128 --providers sigmoid-triton sigmoid-triton-exact cudnn --seq-lens 4096 8192 16384 --paddings 0 --rounds 2 --out $OUT/r/exact > $OUT/r/exact.log 2>&1; echo "exact rc=$? $(date -u +%T)"
cat $OUT/r/exact/attention.md
timeout 215 python3 -m pytest -q -m gpu -n 8 --timeout=200 -p no:cacheprovider -p no:benchmark tests/ > $OUT/r/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests.log | head
tar czf $OUT/call6.tgz -C $OUT r && rm -rf $OUT/r
