# Session 13, call 1 (one H200): the ceiling of the split backward (ceiling.patch applied).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 400 python3 .dev/s13/ceiling.py $OUT/r 5 > $OUT/r/ceiling_full.log 2>&1; echo "ceiling rc=$? $(date -u +%T)"
grep -v "^\s*$" $OUT/r/ceiling_full.log | tail -60
tar czf $OUT/call1.tgz -C $OUT r && rm -rf $OUT/r
