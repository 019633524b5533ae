"""Session 13: the backward kernels with S = Q K^T issued before dP = dO V^T (BWD_S_FIRST; the
sigmoid then runs while dP's wgmma is in flight) vs dP first (as committed), and cuDNN's backward,
through autograd as kernels/bench_attention.py times it; do_bench medians, arms interleaved within
each round.   python3 ab_sfirst.py OUTDIR ROUNDS"""
import os, sys, importlib
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
from stabilitylab.kernels.reference import key_mask_BT

out_dir, rounds = sys.argv[1], int(sys.argv[2])
os.makedirs(out_dir, exist_ok=True)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
shapes = [(D, T, 0.0) for D in (64, 128) for T in (4096, 8192, 16384)] + [
    (64, 8192, 0.25), (128, 8192, 0.25), (64, 4096, 0.5), (128, 4096, 0.5), (64, 1024, 0.0), (128, 1024, 0.0)]
for D, T, pad in shapes:
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, pad)
    fl = 2.5 * flops_fwd(q.shape[1], D, L.tolist())
    out = sigmoid_attention(q, k, v, L)[0]
    g = torch.randn_like(out)
    mask = key_mask_BT(L, T)[:, None, None, :] if pad else None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out_c = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    def arm(flag):
        def f():
            sa.BWD_S_FIRST = flag
            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        return f
    cud = lambda: torch.autograd.grad(out_c, (q, k, v), g, retain_graph=True)
    fns = {"dp-first": arm(False), "s-first": arm(True), "cudnn": cud}
    a, b = fns["dp-first"](), fns["s-first"]()
    torch.cuda.synchronize()
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for n in fns:
        ts = times[n]
        r = [times["dp-first"][i] / ts[i] for i in range(rounds)]
        c = [times["cudnn"][i] / ts[i] for i in range(rounds)]
        line = (f"D={D:3d} T={T:5d} pad={pad:.2f} {n:9s} bwd {fl / med(ts) * 1e-9:6.1f} TFLOPS  vs dp-first {100 * (med(r) - 1):+5.1f}%"
                f" [{100 * (min(r) - 1):+.1f}, {100 * (max(r) - 1):+.1f}]  vs cudnn {100 * (med(c) - 1):+5.1f}%"
                f" [{100 * (min(c) - 1):+.1f}, {100 * (max(c) - 1):+.1f}]  same-grads {same}")
        print(line, flush=True); lines.append(line)
    del q, k, v, out, out_c, g, fns, a, b
    torch.cuda.empty_cache()
open(f"{out_dir}/ab_sfirst.log", "w").write("\n".join(lines) + "\n")
