"""Session 9: the model step bar (kernels/bench_attention.py --model-step) with the op as committed
now (dense kernels for the unpadded batch) and with the dense path off, twice each, alternating."""
import importlib, sys
import torch, triton
sys.argv = [sys.argv[0]]
from stabilitylab.kernels import bench_attention as ba
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
rule = sa.use_dense
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
for rep in range(2):
    for name in ("dense", "general"):
        sa.use_dense = rule if name == "dense" else (lambda *a: False)
        print(f"--- rep {rep} op path: {name}", flush=True)
        df = ba.bench_model_step(None)
        print(df.to_string(), flush=True)
sa.use_dense = rule
