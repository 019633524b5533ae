# Session 11, call 7 (one H200): ab_op_stream.py, 9 rounds (GPU-bound timing of the two arms).
export PYTHONPATH=.
mkdir -p $OUT/r; date -u
timeout 200 python3 .dev/s11/ab_op_stream.py $OUT/r 9 > $OUT/r/ab_op_stream_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -14 $OUT/r/ab_op_stream_full.log
tar czf $OUT/call7.tgz -C $OUT r && rm -rf $OUT/r
