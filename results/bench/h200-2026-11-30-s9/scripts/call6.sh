python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
mkdir -p $OUT/call6
date -u
timeout 170 python3 -m pytest -q -m gpu -n 4 --timeout=160 -p no:cacheprovider -p no:benchmark tests/test_kernels.py -k "dense or lengths_all_full or straight_launch" > $OUT/call6/gputests_review.log 2>&1; echo "gputests rc=$? $(date -u +%T)"
tail -3 $OUT/call6/gputests_review.log; grep -E "^FAILED|^ERROR|^E " $OUT/call6/gputests_review.log | head
