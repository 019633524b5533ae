"""Session 8: the forward with Q_TILES query tiles per program (k_group.py: descriptors built once
per program) vs the committed kernel launched directly, the op and SDPA cuDNN. One process,
interleaved rounds, do_bench medians.      python3 group_ab.py OUTDIR ROUNDS"""
import importlib, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k_group import _fwd_group
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

out_dir, rounds = sys.argv[1], int(sys.argv[2])
triton.set_allocator(sa._device_allocator)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
lines = []
cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)


def launcher(kern, q, k, v, L, D, a_regs, qt, return_max=False):
    B, H, T, _ = q.shape
    out = sa._empty_bthd_as_bhtd(q)
    n_m = triton.cdiv(T, 128)
    mx = torch.zeros(B * H, n_m, dtype=torch.float32, device="cuda") if return_max else torch.zeros(1, device="cuda")
    args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, n_m if return_max else 1, 1 / math.sqrt(D), 0.0)
    kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=return_max, DOT_PRECISION="tf32",
              TMA=True, LOOKAHEAD=True, A_REGS=a_regs, **cfg)
    if qt:
        kw["Q_TILES"] = qt
        grid = (triton.cdiv(n_m, qt), B * H)
    else:
        grid = (n_m, B * H)
    return (lambda: kern[grid](*args, **kw)), out, mx


for D in (128, 64):
    a_regs = D == 128
    for T, pad in ((4096, 0.0), (8192, 0.0), (16384, 0.0), (4096, 0.25), (16384, 0.25), (4096, 0.5)):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, pad)
        q, k, v = (t.detach() for t in (q, k, v))
        B, H = q.shape[:2]
        fl = flops_fwd(H, D, L.tolist())
        fns, outs = {}, {}
        fns["op"] = lambda: sa.sigmoid_attention(q, k, v, L)
        if pad == 0:
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v)
            fns["cudnn"] = cud
        variants = [("grid", sa._sigmoid_fwd_kernel, 0), ("group2", _fwd_group, 2), ("group4", _fwd_group, 4),
                    ("group8", _fwd_group, 8)]
        for name, kern, qt in variants:
            f, out, _ = launcher(kern, q, k, v, L, D, a_regs, qt)
            try:
                f(); torch.cuda.synchronize()
            except Exception as e:
                print(f"D={D} T={T} pad={pad} {name}: {type(e).__name__} {str(e)[:160]}", flush=True)
                continue
            fns[name] = f; outs[name] = out
            if pad == 0.25 and T == 4096:  # the fused max too
                f2, o2, mx2 = launcher(kern, q, k, v, L, D, a_regs, qt, return_max=True)
                f2(); torch.cuda.synchronize()
                outs[name + "+max"] = o2
                mxs = outs.setdefault("_mx", {})
                mxs[name] = mx2.amax(1)
        ref = outs["grid"]
        same = {n: torch.equal(o, ref) for n, o in outs.items() if n != "_mx"}
        if "_mx" in outs:
            m0 = outs["_mx"]["grid"]
            print(f"D={D} T={T} pad={pad} max equal: " + ", ".join(f"{n}={torch.equal(m, m0)}" for n, m in outs["_mx"].items()), flush=True)
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=50))
        for n in fns:
            ts = sorted(times[n]); ms = ts[len(ts) // 2]
            line = (f"D={D:3d} T={T:5d} pad={pad:.2f} {n:8s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS "
                    f"[{fl / ts[-1] * 1e-9:4.0f}, {fl / ts[0] * 1e-9:4.0f}] same-as-grid {same.get(n, '-')}")
            print(line, flush=True); lines.append(line)
with open(f"{out_dir}/group_ab.log", "w") as f:
    f.write("\n".join(lines) + "\n")
