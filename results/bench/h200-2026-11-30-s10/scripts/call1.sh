# Session 10, call 1 (nvidia-h200-x2): the all-provider table with 3 interleaved rounds (hd 64 on
# GPU 0, hd 128 on GPU 1, at once), then the model step alone on GPU 1, then the GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
P="sigmoid-triton cudnn flash eager-sigmoid sigmoid-triton-exact flex"
date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm,driver_version --format=csv | tee $OUT/gpus.log
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.version.cuda, torch.cuda.device_count())"
( CUDA_VISIBLE_DEVICES=0 timeout 300 python3 kernels/bench_attention.py --head-dims 64 --providers $P --rounds 3 --out $OUT/bench64 > $OUT/bench64.log 2>&1; echo "bench64 rc=$? $(date -u +%T)" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 300 python3 kernels/bench_attention.py --head-dims 128 --providers $P --rounds 3 --out $OUT/bench128 > $OUT/bench128.log 2>&1; echo "bench128 rc=$? $(date -u +%T)" ) &
wait
CUDA_VISIBLE_DEVICES=1 timeout 90 python3 kernels/bench_attention.py --model-step --rounds 3 --out $OUT/model_step > $OUT/model_step.log 2>&1; echo "model-step rc=$? $(date -u +%T)"
timeout 170 python3 -m pytest -q -m gpu -n 8 --timeout=160 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
cat $OUT/bench64/bars.md $OUT/bench128/bars.md $OUT/model_step/model_step.md 2>/dev/null
tail -1 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
tail -3 $OUT/bench64.log $OUT/bench128.log
