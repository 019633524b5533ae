# Session 11, call 6 (one H200): ab_op.py, the op's dense forward with and without the split tail, 7 rounds.
export PYTHONPATH=.
mkdir -p $OUT/r; date -u
timeout 240 python3 .dev/s11/ab_op.py $OUT/r 7 > $OUT/r/ab_op_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -20 $OUT/r/ab_op_full.log
tar czf $OUT/call6.tgz -C $OUT r && rm -rf $OUT/r
