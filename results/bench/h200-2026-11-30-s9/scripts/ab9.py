"""Session 9: the op (dense kernels for unpadded batches) vs the same op with the dense path off
(the general kernels, as committed before) vs SDPA cuDNN; forward and backward; and the op under
25% padding. One process, interleaved rounds.    python3 ab9.py OUTDIR ROUNDS"""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
out_dir, rounds = sys.argv[1], int(sys.argv[2])
rows = []
def emit(s):
    print(s, flush=True); rows.append(s)
emit(f"{torch.__version__} {triton.__version__} {torch.cuda.get_device_name()} {sa.BWD_LEVERS}")
dense_rule = sa.use_dense


def general(f):
    def g():
        sa.use_dense = lambda *a: False
        try:
            return f()
        finally:
            sa.use_dense = dense_rule
    return g


import os
SHAPES = os.environ.get("SHAPES")  # "D:T:pad,..." to run only these
for D in (128, 64):
    for T, pad in ((1024, 0.0), (2048, 0.0), (4096, 0.0), (8192, 0.0), (16384, 0.0),
                   (4096, 0.25), (8192, 0.25), (16384, 0.25)):
        if D == 64 and T < 4096:
            continue
        if SHAPES and f"{D}:{T}:{pad}" not in SHAPES.split(","):
            continue
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, pad)
        fl = flops_fwd(q.shape[1], D, L.tolist())
        qd, kd, vd = (t.detach() for t in (q, k, v))
        out = sa.sigmoid_attention(q, k, v, L)[0]
        do = torch.randn_like(out)
        fwd = lambda: sa.sigmoid_attention(qd, kd, vd, L)
        bwd = lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        fns = {"fwd op": fwd, "bwd op": bwd}
        if pad == 0:
            emit(f"D={D} T={T} dense={sa.use_dense(L, qd, kd, vd)}")
            o1 = fwd()[0]; o2 = general(fwd)()[0]
            g1 = bwd(); g2 = general(bwd)()
            emit(f"   op vs general: fwd maxdiff {(o1.float()-o2.float()).abs().max().item():.3g} equal {torch.equal(o1, o2)}; "
                 f"grads equal {[torch.equal(a, b) for a, b in zip(g1, g2)]}")
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                oc = F.scaled_dot_product_attention(q, k, v)
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd)
            fns = {"fwd op": fwd, "fwd general": general(fwd), "fwd cudnn": cud,
                   "bwd op": bwd, "bwd general": general(bwd),
                   "bwd cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
        res = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
        for n in fns:
            ms = sorted(res[n])[len(res[n]) // 2]
            c = 2.5 if n.startswith("bwd") else 1.0
            emit(f"D={D:3d} T={T:5d} pad={pad:.2f} {n:12s} {ms:8.4f} ms {c*fl/ms*1e-9:6.1f} TFLOPS [{c*fl/max(res[n])*1e-9:5.0f}, {c*fl/min(res[n])*1e-9:5.0f}]")
        if pad == 0:
            for kind in ("fwd", "bwd"):
                for n in (f"{kind} op", f"{kind} general"):
                    r = sorted(a / b - 1 for a, b in zip(res[f"{kind} cudnn"], res[n]))
                    emit(f"   {n:12s} vs cudnn per-round gain median {r[len(r)//2]:+.1%} range [{r[0]:+.1%}, {r[-1]:+.1%}]")
                r = sorted(a / b - 1 for a, b in zip(res[f"{kind} general"], res[f"{kind} op"]))
                emit(f"   {kind} op vs general per-round gain median {r[len(r)//2]:+.1%} range [{r[0]:+.1%}, {r[-1]:+.1%}]")
from stabilitylab.kernels import autotune_choices
for kk, vv in autotune_choices().items():
    emit(f"{kk} {vv}")
with open(f"{out_dir}/ab9.log", "w") as f:
    f.write("\n".join(rows) + "\n")
