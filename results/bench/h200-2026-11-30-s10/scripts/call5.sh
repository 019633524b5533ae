# Session 10, call 5 (one H200), the final code: the model step bar (3 alternating rounds), then
# the kernel GPU tests that touch this session's changes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/r; date -u
timeout 120 python3 kernels/bench_attention.py --model-step --rounds 3 --out $OUT/r/model_step > $OUT/r/model_step.log 2>&1; echo "model-step rc=$? $(date -u +%T)"
cat $OUT/r/model_step/model_step.md
timeout 150 python3 -m pytest -q -m gpu -n 8 --timeout=140 -p no:cacheprovider -p no:benchmark -k "specialisation or dense or matches_reference or fullgraph or compiled_model" tests/ > $OUT/r/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -1 $OUT/r/gputests.log; grep -E "^FAILED|^ERROR" $OUT/r/gputests.log | head
tar czf $OUT/call5.tgz -C $OUT r && rm -rf $OUT/r
