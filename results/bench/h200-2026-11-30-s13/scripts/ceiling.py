"""Session 13: the ceiling of the atomics-free split backward. Arm ``ceiling`` runs the op's
backward kernels (same launcher, configs, levers, dense/general choice) with SIGMOID == 2: the
sigmoid and dS formula removed, every one of the 7 matrix products kept live (dS := dP + S in the
dQ kernel; P^T := S^T, dS^T := dP^T in the dK/dV kernel). Against it: the op's backward (fast
sigmoid) called the same way, the op through autograd (as the table times it), and cuDNN's
softmax backward through autograd. do_bench medians, arms interleaved within each round; then a
per-kernel breakdown from torch.profiler at T = 8K.   python3 ceiling.py OUTDIR ROUNDS"""
import math, os, sys
from collections import defaultdict
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.sigmoid_attention import backward_auto, TANH_F32
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
from stabilitylab.kernels.reference import key_mask_BT

out_dir, rounds = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
def say(s):
    print(s, flush=True); lines.append(s)

# 1. The ceiling arm computes what it says (every product live): against fp32 torch, unpadded.
for D in (64, 128):
    torch.manual_seed(1)
    q, k, v, L = make_inputs(1024, D, 0.0)
    q, k, v = (t.detach()[:2] for t in (q, k, v)); L = L[:2]
    do = torch.randn_like(q)
    sc = 1 / math.sqrt(D)
    dq, dk, dv = backward_auto(do, q, k, v, L, sc, 0.0, True, 2)
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    S = qf @ kf.transpose(-1, -2); dP = dof @ vf.transpose(-1, -2)
    ref = ((dP + S) @ kf * 0.25 * sc, dP.transpose(-1, -2) @ qf * 0.25 * sc, S.transpose(-1, -2) @ dof)
    errs = [((a.float() - r).norm() / r.norm()).item() for a, r in zip((dq, dk, dv), ref)]
    say(f"ceiling check D={D}: rel err dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e} -> {'ok' if max(errs) < 2e-2 else 'WRONG'}")

# 2. Timing.
shapes = [(D, T, 0.0) for D in (64, 128) for T in (4096, 8192, 16384)] + [(64, 8192, 0.25), (128, 8192, 0.25)]
prof_fns = {}
for D, T, pad in shapes:
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, pad)
    fl = 2.5 * flops_fwd(q.shape[1], D, L.tolist())
    out = sigmoid_attention(q, k, v, L)[0]
    g = torch.randn_like(out)
    mask = key_mask_BT(L, T)[:, None, None, :] if pad else None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_c = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    sc = 1 / math.sqrt(D)
    fns = {
        "op-autograd": lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True),
        "op-bwd": lambda: backward_auto(g, qd, kd, vd, L, sc, 0.0, True, TANH_F32),
        "ceiling": lambda: backward_auto(g, qd, kd, vd, L, sc, 0.0, True, 2),
        "cudnn": lambda: torch.autograd.grad(out_c, (q, k, v), g, retain_graph=True),
    }
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
        say(f"D={D:3d} T={T:5d} pad={pad:.2f} {n:12s} {med(ts):7.3f} ms {fl / med(ts) * 1e-9:6.1f} TFLOPS"
            f"  vs cudnn {100 * (med(c) - 1):+6.1f}% [{100 * (min(c) - 1):+.1f}, {100 * (max(c) - 1):+.1f}]")
    if T == 8192:
        acts = [torch.profiler.ProfilerActivity.CUDA]
        for n in ("op-bwd", "ceiling", "cudnn"):
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(10):
                    fns[n]()
                torch.cuda.synchronize()
            per = defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name[:60]] += e.device_time_total / 10 / 1e3
            top = sorted(per.items(), key=lambda x: -x[1])[:4]
            say(f"  kernels D={D} T={T} pad={pad:.2f} {n}: " + "; ".join(f"{k} {v:.3f} ms" for k, v in top))
    del q, k, v, out, out_c, g, fns
    torch.cuda.empty_cache()
open(f"{out_dir}/ceiling.log", "w").write("\n".join(lines) + "\n")
