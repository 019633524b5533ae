"""Session 6 A/B, one process, interleaved: the op with host-built descriptors (HEAD) vs the op as
of acb2de2 (in-kernel descriptors; .dev/s6/sa_old.py, op namespace renamed), and SDPA cuDNN.
    python3 ab.py D ROUNDS"""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
new = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
sys.path.insert(0, ".dev/s6")
old = importlib.import_module("sa_old")
D, rounds = int(sys.argv[1]), int(sys.argv[2])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
rows = []
for T in (4096, 8192, 16384):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    fl = flops_fwd(q.shape[1], D, L.tolist())
    do = torch.randn_like(q)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    on = new.sigmoid_attention(q, k, v, L)[0]
    oo = old.sigmoid_attention(q, k, v, L)[0]
    gn = torch.autograd.grad(on, (q, k, v), do, retain_graph=True)
    go = torch.autograd.grad(oo, (q, k, v), do, retain_graph=True)
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    devs = [rel(on, oo)] + [rel(a, b) for a, b in zip(gn, go)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        oc = F.scaled_dot_product_attention(q, k, v)
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qd, kd, vd)
    fns = {"fwd host-desc (new)": lambda: new.sigmoid_attention(qd, kd, vd, L),
           "fwd in-kernel desc (old)": lambda: old.sigmoid_attention(qd, kd, vd, L),
           "fwd cudnn": cud,
           "bwd host-desc (new)": lambda: torch.autograd.grad(on, (q, k, v), do, retain_graph=True),
           "bwd in-kernel desc (old)": lambda: torch.autograd.grad(oo, (q, k, v), do, retain_graph=True),
           "bwd cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for n in fns:
        ms = sorted(res[n])[len(res[n]) // 2]
        tf = (2.5 if n.startswith("bwd") else 1.0) * fl / ms * 1e-9
        rows.append((T, n, ms, tf, min(res[n]), max(res[n])))
    print(f"D={D} T={T} done; new vs old rel dev out/dq/dk/dv: {' '.join(f'{d:.1g}' for d in devs)}", flush=True)
print(f"\n{'D':>4} {'T':>6} {'what':26s} {'ms':>8} {'TFLOPS':>7}  [min, max ms]")
for T, n, ms, tf, lo, hi in rows:
    print(f"{D:4d} {T:6d} {n:26s} {ms:8.4f} {tf:7.1f}  [{lo:.4f}, {hi:.4f}]")
