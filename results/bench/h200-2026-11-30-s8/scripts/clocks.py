"""Session 8: SM clock and board power while the op and SDPA cuDNN run back to back (each for a
few seconds, hd 128), sampled by nvidia-smi every 50 ms.     python3 clocks.py OUTDIR"""
import importlib, subprocess, sys, time
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
out_dir = sys.argv[1]
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader,nounits", "-lms", "50"], stdout=open(f"{out_dir}/smi.csv", "w"))
time.sleep(1.0)
windows = []
for D, T in ((128, 4096), (128, 16384), (64, 8192)):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    out = sa.sigmoid_attention(q, k, v, L)[0]
    do = torch.randn_like(out)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(q, k, v)
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd)
    fns = {"fwd op": lambda: sa.sigmoid_attention(qd, kd, vd, L), "fwd cudnn": cud,
           "bwd op": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
           "bwd cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
    for rep in range(2):
        for n, f in fns.items():
            f(); torch.cuda.synchronize()
            t0 = time.time(); calls = 0
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            while time.time() - t0 < 2.5:
                for _ in range(5):
                    f()
                calls += 5
                torch.cuda.synchronize()
            e1.record(); torch.cuda.synchronize()
            t1 = time.time()
            windows.append((D, T, n, rep, t0 + 0.5, t1, e0.elapsed_time(e1) / calls))
            time.sleep(0.5)
time.sleep(0.3)
smi.terminate(); smi.wait()
rows = []
for line in open(f"{out_dir}/smi.csv"):
    parts = [x.strip() for x in line.split(",")]
    try:
        ts = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + parts[0].split(".")[1])
        rows.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
    except Exception:
        pass
rows = np.array([(r[0], r[1], r[2], r[3]) for r in rows])
lines = []
for D, T, n, rep, a, b, ms in windows:
    sel = rows[(rows[:, 0] >= a) & (rows[:, 0] <= b)]
    if len(sel) == 0:
        continue
    line = (f"D={D} T={T:5d} {n:9s} round {rep}: {ms:.3f} ms/call; SM clock median {np.median(sel[:, 1]):.0f} MHz "
            f"[{sel[:, 1].min():.0f}, {sel[:, 1].max():.0f}], power {np.median(sel[:, 2]):.0f} W, temp {np.median(sel[:, 3]):.0f} C, n={len(sel)}")
    print(line, flush=True); lines.append(line)
with open(f"{out_dir}/clocks.log", "w") as f:
    f.write("\n".join(lines) + "\n")
