"""Session 13: the dense dQ kernel (hd 128, unpadded) with S and dP of key tile j+1 issued after
the sigmoid of tile j and carried (BWD_DQ_LA = 1), vs as committed (0), and cuDNN's backward,
through autograd; do_bench medians, arms interleaved per round; dQ kernel times from the profiler.
    python3 ab_dqla.py OUTDIR ROUNDS"""
import os, sys, importlib
from collections import defaultdict
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

out_dir, rounds = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
def say(x):
    print(x, flush=True); lines.append(x)
for D, T in [(128, 4096), (128, 8192), (128, 16384), (128, 1024), (128, 2048)]:
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    fl = 2.5 * flops_fwd(q.shape[1], D, L.tolist())
    out = sigmoid_attention(q, k, v, L)[0]
    g = torch.randn_like(out)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_c = F.scaled_dot_product_attention(q, k, v)
    def arm(flag):
        def f():
            sa.BWD_DQ_LA = flag
            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        return f
    fns = {"la0": arm(0), "la1": arm(1), "cudnn": lambda: torch.autograd.grad(out_c, (q, k, v), g, retain_graph=True)}
    a, b = fns["la0"](), fns["la1"]()
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    dmax = max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for n in fns:
        ts = times[n]
        r = [times["la0"][i] / ts[i] for i in range(rounds)]
        c = [times["cudnn"][i] / ts[i] for i in range(rounds)]
        say(f"D={D:3d} T={T:5d} {n:6s} bwd {fl / med(ts) * 1e-9:6.1f} TFLOPS  vs la0 {100 * (med(r) - 1):+5.1f}%"
            f" [{100 * (min(r) - 1):+.1f}, {100 * (max(r) - 1):+.1f}]  vs cudnn {100 * (med(c) - 1):+5.1f}%"
            f" [{100 * (min(c) - 1):+.1f}, {100 * (max(c) - 1):+.1f}]  same-grads {same} maxdiff {dmax:.2e}")
    if T in (4096, 8192):
        for n in ("la0", "la1"):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
                for _ in range(10):
                    fns[n]()
                torch.cuda.synchronize()
            per = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name[:40]] += e.device_time_total / 10 / 1e3
            say(f"  kernels T={T} {n}: " + "; ".join(f"{k} {v:.3f} ms" for k, v in sorted(per.items(), key=lambda x: -x[1])[:3]))
    del q, k, v, out, out_c, g, fns, a, b
    torch.cuda.empty_cache()
for key, tuned in sa._TUNED.items():
    if "dq_dense" in str(key[0]):
        for k2, best in tuned._best.items():
            say(f"chosen dq_dense key={k2} -> " + ",".join(f"{a}={best[a]}" for a in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")))
open(f"{out_dir}/ab_dqla.log", "w").write("\n".join(lines) + "\n")
