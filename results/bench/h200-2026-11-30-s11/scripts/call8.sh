# Session 11, call 8 (one H200): ab_grid.py, 132 vs 128 persistent programs, 9 rounds.
export PYTHONPATH=.
mkdir -p $OUT/r; date -u
timeout 150 python3 .dev/s11/ab_grid.py $OUT/r 9 > $OUT/r/ab_grid_full.log 2>&1; echo "ab rc=$? $(date -u +%T)"
tail -14 $OUT/r/ab_grid_full.log
tar czf $OUT/call8.tgz -C $OUT r && rm -rf $OUT/r
