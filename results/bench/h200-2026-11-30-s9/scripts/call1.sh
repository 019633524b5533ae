set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/call1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv > $OUT/call1/gpu.txt
timeout 560 python3 .dev/s9/ab_dense.py $OUT/call1 5 > $OUT/call1/stdout.log 2>&1
tail -80 $OUT/call1/stdout.log
