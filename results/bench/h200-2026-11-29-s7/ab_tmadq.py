"""Session 7: the op's backward with the dQ kernel on TMA (BWD_LEVERS["tma_dq"] = True) vs as
committed (False), and SDPA cuDNN, one process, interleaved rounds.   python3 ab_tmadq.py ROUNDS"""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
rounds = int(sys.argv[1])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)

def bwd(out, q, k, v, do, flag):
    def f():
        sa.BWD_LEVERS["tma_dq"] = flag
        return torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    return f

rows = []
for D in (64, 128):
    for T in (4096, 8192, 16384):
        for pad in (0.0, 0.25):
            torch.manual_seed(0)
            q, k, v, L = make_inputs(T, D, pad)
            fl = flops_fwd(q.shape[1], D, L.tolist())
            out = sa.sigmoid_attention(q, k, v, L)[0]
            do = torch.randn_like(out)
            g_on = bwd(out, q, k, v, do, True)()
            g_off = bwd(out, q, k, v, do, False)()
            same = all(torch.equal(a, b) for a, b in zip(g_on, g_off))
            fns = {"bwd dq on TMA": bwd(out, q, k, v, do, True), "bwd as committed": bwd(out, q, k, v, do, False)}
            if pad == 0.0:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    oc = F.scaled_dot_product_attention(q, k, v)
                fns["bwd cudnn"] = lambda oc=oc, do=do, q=q, k=k, v=v: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)
            res = {n: [] for n in fns}
            for _ in range(rounds):
                for n, f in fns.items():
                    res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
            for n in fns:
                ms = sorted(res[n])[len(res[n]) // 2]
                rows.append((D, T, pad, n, ms, 2.5 * fl / ms * 1e-9, min(res[n]), max(res[n])))
            print(f"D={D} T={T} pad={pad} done; gradients bit-identical: {same}", flush=True)
sa.BWD_LEVERS["tma_dq"] = False
print(f"\n{'D':>4} {'T':>6} {'pad':>5} {'what':20s} {'ms':>8} {'TFLOPS':>7}  [min, max ms]")
for D, T, pad, n, ms, tf, lo, hi in rows:
    print(f"{D:4d} {T:6d} {pad:5.2f} {n:20s} {ms:8.4f} {tf:7.1f}  [{lo:.4f}, {hi:.4f}]")
