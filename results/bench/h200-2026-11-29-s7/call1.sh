#!/bin/bash
# Session 7, call 1: levers A_REGS (loop-invariant wgmma A operand in registers) and TANH_MIX
# (1 sigmoid in 4 on the FMA pipe), each kernel alone, production configs, 3 interleaved rounds.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
python3 kernels/sweep_configs.py --head-dims 64 128 --seq-lens 4096 8192 16384 \
  --fwd-levers 1100 1101 1110 1111 --levers 0000 0001 0010 1000 1001 1010 \
  --configs fwd=128x128x8x3,128x64x8x3,128x64x4x3 dq=128x64x8x3,128x64x8x4,64x64x4x3 \
            dkdv=64x128x8x3,64x64x4x3,64x64x4x2 \
  --repeat 3 --workers 16 --out $OUT/sweep 2>&1 | grep -v "^warm fail" | tail -150
python3 - <<'PY'
import pandas as pd, os
df = pd.read_csv(os.environ["OUT"] + "/sweep/sweep.csv")
print(df[df.kernel != "cudnn"].groupby(["D", "kernel", "tma", "lookahead", "a_regs", "mix"]).rel_dev.max().to_string())
print(df[df.err.fillna("") != ""][["D","T","kernel","tma","lookahead","a_regs","mix","config","err"]].to_string())
PY
