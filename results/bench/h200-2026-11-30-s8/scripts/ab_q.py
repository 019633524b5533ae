"""Session 8: the op with four query tiles per forward program at head dim 128 (FWD_Q_TILES = 4)
vs the same op with one (FWD_Q_TILES = 1, the kernel as before), vs SDPA cuDNN; forward and
backward, one process, interleaved rounds.     python3 ab_q.py OUTDIR ROUNDS"""
import importlib, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
out_dir, rounds = sys.argv[1], int(sys.argv[2])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), sa.BWD_LEVERS, sa.FWD_Q_TILES, flush=True)


def with_tiles(n, f):
    def g():
        sa.FWD_Q_TILES = n
        try:
            return f()
        finally:
            sa.FWD_Q_TILES = 4
    return g


rows = []
ONLY_FWD = os.environ.get("ONLY_FWD") == "1"
for D in ((128,) if ONLY_FWD else (128, 64)):
    for T, pad in ((4096, 0.0), (8192, 0.0), (16384, 0.0), (4096, 0.25), (16384, 0.25)):
        if D == 64 and pad:
            continue
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, pad)
        fl = flops_fwd(q.shape[1], D, L.tolist())
        qd, kd, vd = (t.detach() for t in (q, k, v))
        fwd = lambda: sa.sigmoid_attention(qd, kd, vd, L)
        o4, m4 = with_tiles(4, lambda: sa.sigmoid_attention(qd, kd, vd, L, return_max_logit=True))()
        o1, m1 = with_tiles(1, lambda: sa.sigmoid_attention(qd, kd, vd, L, return_max_logit=True))()
        same = torch.equal(o4, o1) and torch.equal(m4, m1)
        fns = {"fwd op q4": with_tiles(4, fwd), "fwd op q1": with_tiles(1, fwd)}
        if ONLY_FWD:
            for qt in (4, 1):
                B, H = q.shape[:2]
                o = sa._empty_bthd_as_bhtd(qd)
                mx = torch.zeros(1, device="cuda")
                args = sa._kernel_args((qd, kd, vd, o), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
                kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
                          TMA=True, LOOKAHEAD=True, A_REGS=True, Q_TILES=qt, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
                grid = (triton.cdiv(triton.cdiv(T, 128), qt), B * H)
                fns[f"direct q{qt}"] = (lambda args=args, kw=kw, grid=grid: sa._sigmoid_fwd_kernel[grid](*args, **kw))
        if pad == 0 and ONLY_FWD:
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd)
            fns["fwd cudnn"] = cud
        if pad == 0 and not ONLY_FWD:
            out = sa.sigmoid_attention(q, k, v, L)[0]
            do = torch.randn_like(out)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                oc = F.scaled_dot_product_attention(q, k, v)
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qd, kd, vd)
            fns.update({"fwd cudnn": cud,
                        "bwd op": lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                        "bwd cudnn": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)})
        res = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
        for n in fns:
            ms = sorted(res[n])[len(res[n]) // 2]
            tf = (2.5 if n.startswith("bwd") else 1.0) * fl / ms * 1e-9
            line = (f"D={D:3d} T={T:5d} pad={pad:.2f} {n:10s} {ms:8.4f} ms {tf:6.1f} TFLOPS "
                    f"[{(2.5 if n.startswith('bwd') else 1.0) * fl / max(res[n]) * 1e-9:5.0f}, "
                    f"{(2.5 if n.startswith('bwd') else 1.0) * fl / min(res[n]) * 1e-9:5.0f}]  q4==q1 {same}")
            print(line, flush=True); rows.append(line)
from stabilitylab.kernels import autotune_choices
for kk, vv in autotune_choices().items():
    print(kk, vv); rows.append(f"{kk} {vv}")
with open(f"{out_dir}/ab_q{'_fwd' if ONLY_FWD else ''}.log", "w") as f:
    f.write("\n".join(rows) + "\n")
