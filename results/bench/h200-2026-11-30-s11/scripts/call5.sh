# Session 11, call 5 (one H200), the final code (the forward's last round split by keys): the full
# GPU test suite, then the all-provider table at hd 128 (3 rounds; hd 64 does not take the dense
# forward, its table is call 2's).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
P="sigmoid-triton cudnn flash eager-sigmoid sigmoid-triton-exact flex"
mkdir -p $OUT/r; date -u
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/r/gpus.log 2>&1
timeout 230 python3 -m pytest -q -m gpu -n 8 --timeout=200 -p no:cacheprovider -p no:benchmark tests/ > $OUT/r/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests.log | head
timeout 300 python3 kernels/bench_attention.py --head-dims 128 --providers $P --rounds 3 --out $OUT/r/bench128 > $OUT/r/bench128.log 2>&1; echo "bench128 rc=$? $(date -u +%T)"
cat $OUT/r/bench128/bars.md
tar czf $OUT/call5.tgz -C $OUT r && rm -rf $OUT/r
