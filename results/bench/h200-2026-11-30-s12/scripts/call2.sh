# Session 12, call 2 (nvidia-h200-x2), the final code (53ba8f4, persistent_grid): the all-provider
# table, hd 64 on GPU 0 and hd 128 on GPU 1 at once, 3 interleaved rounds; then the model step on
# GPU 1 while the full GPU suite runs on GPU 0.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
P="sigmoid-triton cudnn flash eager-sigmoid sigmoid-triton-exact flex"
mkdir -p $OUT/r; date -u
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv > $OUT/r/gpus.log 2>&1
( CUDA_VISIBLE_DEVICES=0 timeout 280 python3 kernels/bench_attention.py --head-dims 64 --providers $P --rounds 3 --out $OUT/r/bench64 > $OUT/r/bench64.log 2>&1; echo "bench64 rc=$? $(date -u +%T)" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 290 python3 kernels/bench_attention.py --head-dims 128 --providers $P --rounds 3 --out $OUT/r/bench128 > $OUT/r/bench128.log 2>&1; echo "bench128 rc=$? $(date -u +%T)" ) &
wait
( CUDA_VISIBLE_DEVICES=1 timeout 150 python3 kernels/bench_attention.py --model-step --rounds 3 --out $OUT/r/model_step > $OUT/r/model_step.log 2>&1; echo "model-step rc=$? $(date -u +%T)" ) &
( CUDA_VISIBLE_DEVICES=0 timeout 260 python3 -m pytest -q -m gpu -n 8 --timeout=200 -p no:cacheprovider -p no:benchmark tests/ > $OUT/r/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)" ) &
wait
tail -1 $OUT/r/gputests.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests.log | head
cat $OUT/r/bench64/bars.md $OUT/r/bench128/bars.md $OUT/r/model_step/model_step.md 2>/dev/null
tar czf $OUT/call2.tgz -C $OUT r && rm -rf $OUT/r
