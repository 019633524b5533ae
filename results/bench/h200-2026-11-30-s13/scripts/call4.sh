# Session 13, call 4 (one H200): A/B of the dense dQ kernel with S and dP carried one key tile ahead (BWD_DQ_LA).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u; nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
timeout 300 python3 .dev/s13/ab_dqla.py $OUT/r 5 > $OUT/r/ab_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
grep -v "^\s*$" $OUT/r/ab_full.log | tail -50
tar czf $OUT/call4.tgz -C $OUT r && rm -rf $OUT/r
