python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/call4
date -u
timeout 240 python3 .dev/s9/ms9.py > $OUT/call4/ms9.log 2>&1; echo "ms rc=$? $(date -u +%T)"
grep -v "^_" $OUT/call4/ms9.log | tail -40
SHAPES=128:4096:0.0 timeout 150 python3 .dev/s9/ab9.py $OUT/call4 12 > $OUT/call4/ab9_4k_stdout.log 2>&1; echo "ab rc=$? $(date -u +%T)"
grep -v "^_" $OUT/call4/ab9_4k_stdout.log | tail -20
