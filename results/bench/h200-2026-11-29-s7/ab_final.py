"""Session 7, the bars with the committed code: the op vs SDPA cuDNN, forward and backward, one
process, interleaved rounds.   python3 ab_final.py ROUNDS"""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
rounds = int(sys.argv[1])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), sa.BWD_LEVERS, sa.FWD_A_REGS_HEAD_DIMS, flush=True)
rows = []
for D in (64, 128):
    for T in (4096, 8192, 16384):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, 0.0)
        fl = flops_fwd(q.shape[1], D, L.tolist())
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
        res = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
        for n in fns:
            ms = sorted(res[n])[len(res[n]) // 2]
            rows.append((D, T, n, ms, (2.5 if n.startswith("bwd") else 1.0) * fl / ms * 1e-9, min(res[n]), max(res[n])))
        print(f"D={D} T={T} done", flush=True)
print(f"\n{'D':>4} {'T':>6} {'what':10s} {'ms':>8} {'TFLOPS':>7}  [min, max ms]")
for D, T, n, ms, tf, lo, hi in rows:
    print(f"{D:4d} {T:6d} {n:10s} {ms:8.4f} {tf:7.1f}  [{lo:.4f}, {hi:.4f}]")
