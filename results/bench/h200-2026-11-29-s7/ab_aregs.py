"""Session 7: the op with A_REGS at hd 128 (HEAD) vs the op without (FWD_A_REGS_HEAD_DIMS = ()),
and SDPA cuDNN, one process, interleaved rounds.   python3 ab_aregs.py ROUNDS"""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
rounds = int(sys.argv[1])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
ON, OFF = (128,), ()

def op(qd, kd, vd, L, flag):
    def f():
        sa.FWD_A_REGS_HEAD_DIMS = flag
        return sa.sigmoid_attention(qd, kd, vd, L)
    return f

rows = []
shapes = [(D, T, 0.0) for D in (64, 128) for T in (4096, 8192, 16384)]
shapes += [(128, T, p) for T in (1024, 2048) for p in (0.0, 0.25, 0.5)]
shapes += [(128, T, p) for T in (4096, 8192, 16384) for p in (0.25, 0.5)]
for D, T, pad in shapes:
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, pad)
    fl = flops_fwd(q.shape[1], D, L.tolist())
    qd, kd, vd = (t.detach() for t in (q, k, v))
    o_on = op(qd, kd, vd, L, ON)()[0]
    o_off = op(qd, kd, vd, L, OFF)()[0]
    same = torch.equal(o_on, o_off)
    fns = {"fwd op (a_regs at 128)": op(qd, kd, vd, L, ON), "fwd op without a_regs": op(qd, kd, vd, L, OFF)}
    if pad == 0.0:
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd)
        sa.FWD_A_REGS_HEAD_DIMS = ON
        on = sa.sigmoid_attention(q, k, v, L)[0]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(q, k, v)
        do = torch.randn_like(on)
        fns["fwd cudnn"] = cud
        fns["bwd op"] = lambda: torch.autograd.grad(on, (q, k, v), do, retain_graph=True)
        fns["bwd cudnn"] = lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for n in fns:
        ms = sorted(res[n])[len(res[n]) // 2]
        tf = (2.5 if n.startswith("bwd") else 1.0) * fl / ms * 1e-9
        rows.append((D, T, pad, n, ms, tf, min(res[n]), max(res[n])))
    print(f"D={D} T={T} pad={pad} done; outputs with/without a_regs bit-identical: {same}", flush=True)
sa.FWD_A_REGS_HEAD_DIMS = ON
print(f"\n{'D':>4} {'T':>6} {'pad':>5} {'what':24s} {'ms':>8} {'TFLOPS':>7}  [min, max ms]")
for D, T, pad, n, ms, tf, lo, hi in rows:
    print(f"{D:4d} {T:6d} {pad:5.2f} {n:24s} {ms:8.4f} {tf:7.1f}  [{lo:.4f}, {hi:.4f}]")
