"""Session 13: where the split backward's time over its ceiling goes. The op's backward kernels
(backward_auto: the same launcher, configs and dense/general choice) in five SIGMOID modes:
1 the op (tanh.approx.f32), 2 ceiling (products only: dS := dP + S in dQ; P^T := S^T, dS^T := dP^T
in dK/dV), 4 ceiling + the MUFU (tanh of S in place of S), 3 the op's FP32 chain with tanh replaced
by a multiply (no MUFU). do_bench medians, arms interleaved per round; per-kernel device times from
torch.profiler.   python3 decomp.py OUTDIR ROUNDS"""
import math, os, sys
from collections import defaultdict
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.sigmoid_attention import backward_auto
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

out_dir, rounds = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
def say(s):
    print(s, flush=True); lines.append(s)

MODES = {"op": 1, "ceiling": 2, "ceil+mufu": 4, "fp32-chain": 3}
for D, T in [(64, 8192), (64, 16384), (128, 8192), (128, 16384)]:
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    fl = 2.5 * flops_fwd(q.shape[1], D, L.tolist())
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_c = F.scaled_dot_product_attention(q, k, v)
    g = torch.randn_like(out_c)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    sc = 1 / math.sqrt(D)
    fns = {n: (lambda m=m: backward_auto(g, qd, kd, vd, L, sc, 0.0, True, m)) for n, m in MODES.items()}
    fns["cudnn"] = lambda: torch.autograd.grad(out_c, (q, k, v), g, retain_graph=True)
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for n in fns:
        ts = times[n]
        c = [times["cudnn"][i] / ts[i] for i in range(rounds)]
        say(f"D={D:3d} T={T:5d} {n:11s} {med(ts):7.3f} ms {fl / med(ts) * 1e-9:6.1f} TFLOPS"
            f"  vs cudnn {100 * (med(c) - 1):+6.1f}% [{100 * (min(c) - 1):+.1f}, {100 * (max(c) - 1):+.1f}]")
    for n in MODES:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
            for _ in range(10):
                fns[n]()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:40]] += e.device_time_total / 10 / 1e3
        say(f"  kernels D={D} T={T} {n}: " + "; ".join(f"{k} {v:.3f} ms" for k, v in sorted(per.items(), key=lambda x: -x[1])[:2]))
    del q, k, v, out_c, g, fns
    torch.cuda.empty_cache()
open(f"{out_dir}/decomp.log", "w").write("\n".join(lines) + "\n")

# Which config each backward kernel's autotuning chose, per key.
import importlib
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
for key, tuned in sa._TUNED.items():
    name = str(key[0])
    for k2, best in tuned._best.items():
        if "bwd" in name:
            say(f"chosen {str(name)[-40:]} key={k2} -> " + ",".join(f"{a}={best[a]}" for a in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages") if a in best))

# Forced configs at hd 128, T = 8K (does a 4-warp tile with 2 programs per SM hide the MUFU?).
torch.manual_seed(0)
D, T = 128, 8192
q, k, v, L = make_inputs(T, D, 0.0)
qd, kd, vd = (t.detach() for t in (q, k, v))
g = torch.randn_like(qd)
sc = 1 / math.sqrt(D)
run = lambda m=1: backward_auto(g, qd, kd, vd, L, sc, 0.0, True, m)
ref = run(); torch.cuda.synchronize()
cands = {"dkdv": [(64, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 3), (32, 128, 4, 2)],
         "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3)]}
for kind, kname in (("dkdv", "_sigmoid_bwd_dkdv_dense_kernel"), ("dq", "_sigmoid_bwd_dq_dense_kernel")):
    tl_ = [t for key, t in sa._TUNED.items() if kname in str(key[0])]
    if not tl_:
        say(f"no Tuned found for {kname}; keys: {list(sa._TUNED)[:3]}"); continue
    tuned = tl_[0]
    saved = {k2: dict(tuned._best[k2]) for k2 in tuned._best}
    res = []
    for m, n, w, s in cands[kind]:
        for k2 in tuned._best:
            tuned._best[k2] = {**saved[k2], "BLOCK_M": m, "BLOCK_N": n, "num_warps": w, "num_stages": s}
        try:
            out = run(); torch.cuda.synchronize()
            same = all(torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2) for a, b in zip(out, ref))
            ts = [triton.testing.do_bench(run, warmup=25, rep=100) for _ in range(3)]
            res.append((m, n, w, s, med(ts), same))
        except Exception as e:  # OutOfResources and the like
            res.append((m, n, w, s, float("nan"), type(e).__name__))
    for k2 in tuned._best:
        tuned._best[k2] = saved[k2]
    fl = 2.5 * flops_fwd(q.shape[1], D, L.tolist())
    for m, n, w, s, t, same in res:
        say(f"forced {kind} {m}x{n}x{w}x{s}: op backward {t:.3f} ms {fl / t * 1e-9 if t == t else float('nan'):6.1f} TFLOPS  close-to-chosen {same}")
open(f"{out_dir}/decomp.log", "w").write("\n".join(lines) + "\n")
