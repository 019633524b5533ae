# Session 13, call 3 (one H200): A/B of the backward with S issued before dP (BWD_S_FIRST) vs dP first.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 330 python3 .dev/s13/ab_sfirst.py $OUT/r 5 > $OUT/r/ab_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
grep -v "^\s*$" $OUT/r/ab_full.log | tail -50
tar czf $OUT/call3.tgz -C $OUT r && rm -rf $OUT/r
