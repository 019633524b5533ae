#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=.:/tmp/site TQDM_MININTERVAL=60
date -u; nvidia-smi --query-gpu=name --format=csv,noheader
A="--train.global_batch=8 --train.steps=60 --train.checkpoint_every=0 --telemetry.log_every=1 --telemetry.logit_every=10 --telemetry.layer_every=10 --telemetry.probe_every=30"
timeout 260 accelerate launch --config_file experiments/launch/multi_gpu.yaml --num_processes 2 experiments/stress_8k.py --name=gb8_2gpu_s5 --report=False $A > $OUT/gb8_2gpu.log 2>&1; echo "gb8 2gpu rc=$? $(date -u +%T)"
python3 - <<'PY'
import os
from stabilitylab.analysis.events import load_runs
df = load_runs("runs/gb8_2gpu_s5")
df.to_csv(os.environ["OUT"] + "/scalars.csv", index=False)
df = df[df.step >= 5]
for (arm, tag), g in df[df.tag.str.startswith("perf/")].groupby(["arm", "tag"]):
    print(arm, tag, round(float(g.value.median()), 4), "n", len(g))
PY
tail -3 $OUT/gb8_2gpu.log
cp -r runs/gb8_2gpu_s5/*/summary.json $OUT/ 2>/dev/null; ls runs/gb8_2gpu_s5
(export CUDA_VISIBLE_DEVICES=0; timeout 200 python3 -m pytest -q -m gpu -n 8 --timeout=190 -p no:cacheprovider -p no:benchmark tests/ > $OUT/gputests.log 2>&1; echo "gputests rc=$? $(date -u +%T)")
tail -2 $OUT/gputests.log; grep -E "^FAILED|^ERROR" $OUT/gputests.log | head
