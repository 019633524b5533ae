# Session 11, call 3 (one H200): the partly filled last wave (waves.py, 3 rounds).
export PYTHONPATH=.
mkdir -p $OUT/r; date -u
timeout 400 python3 .dev/s11/waves.py $OUT/r 3 > $OUT/r/waves_full.log 2>&1; echo "waves rc=$? $(date -u +%T)"
tail -20 $OUT/r/waves_full.log
tar czf $OUT/call3.tgz -C $OUT r && rm -rf $OUT/r
