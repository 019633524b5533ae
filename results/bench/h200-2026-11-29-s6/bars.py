"""Session 6: the bar shapes, op vs SDPA cuDNN, do_bench medians over interleaved rounds; the op's
backward with the dQ kernel on pointer loads (production before) and on TMA. GPU only.
    python3 bars.py D ROUNDS"""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
D, rounds = int(sys.argv[1]), int(sys.argv[2])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
rows = []
for T in (4096, 8192, 16384):
    for pad in (0.0, 0.25):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, pad)
        fl = flops_fwd(q.shape[1], D, L.tolist())
        do = torch.randn_like(q)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        o = sigmoid_attention(q, k, v, L)[0]
        def op_bwd(tma_dq):
            def f():
                sa.BWD_LEVERS["tma_dq"] = tma_dq
                return torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
            return f
        fns = {"op fwd": lambda: sigmoid_attention(qd, kd, vd, L),
               "op bwd dq-ptr": op_bwd(False), "op bwd dq-tma": op_bwd(True)}
        if pad == 0.0:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                oc = F.scaled_dot_product_attention(q, k, v)
            def cud_f():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd)
            fns["cudnn fwd"] = cud_f
            fns["cudnn bwd"] = lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)
        # the two backward variants agree
        g0 = op_bwd(False)(); g1 = op_bwd(True)()
        dev = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(g1, g0))
        res = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
        for n in fns:
            ms = sorted(res[n])[len(res[n]) // 2]
            mult = 2.5 if "bwd" in n else 1.0
            rows.append((D, T, pad, n, ms, mult * fl / ms * 1e-9, min(res[n]), max(res[n])))
        print(f"D={D} T={T} pad={pad} done (dq tma vs ptr rel dev {dev:.2g})", flush=True)
sa.BWD_LEVERS["tma_dq"] = False
print(f"\n{'D':>4} {'T':>6} {'pad':>5} {'what':16s} {'ms':>8} {'TFLOPS':>7}  [min, max ms]")
for D, T, pad, n, ms, tf, lo, hi in rows:
    print(f"{D:4d} {T:6d} {pad:5.2f} {n:16s} {ms:8.4f} {tf:7.1f}  [{lo:.4f}, {hi:.4f}]")
