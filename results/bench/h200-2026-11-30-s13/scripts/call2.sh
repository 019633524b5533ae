# Session 13, call 2 (one H200): the decomposition of the split backward (decomp.patch applied).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 300 python3 .dev/s13/decomp.py $OUT/r 5 > $OUT/r/decomp_full.log 2>&1; echo "decomp rc=$? $(date -u +%T)"
grep -v "^\s*$" $OUT/r/decomp_full.log | tail -60
tar czf $OUT/call2.tgz -C $OUT r && rm -rf $OUT/r
