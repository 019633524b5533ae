python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/call2
date -u
TS=1024,2048,4096,8192,16384 WS_T=4096,8192 timeout 560 python3 .dev/s9/ab_dense.py $OUT/call2 5 > $OUT/call2/stdout.log 2>&1; echo "rc=$? $(date -u +%T)"
grep -v "^_" $OUT/call2/stdout.log | grep -v "check d\|check fwd" | tail -120
grep "check\|failed" $OUT/call2/stdout.log | grep -v "equal True" | head
