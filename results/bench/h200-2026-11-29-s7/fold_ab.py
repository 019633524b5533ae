"""Session 7: the forward with the first key tile folded into the loop (the committed candidate)
vs the kernel before it (HEAD~, `gen/old_fwd.py`, cut from git's copy), direct launches at the
op's config, same levers (lookahead; TMA from 4K, pointer loads at 2K; A_REGS at hd 128 with TMA),
and cuDNN; one process, interleaved rounds.   python3 fold_ab.py ROUNDS"""
import importlib, math, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, ".dev/s7/gen")
from old_fwd import _fwd_old
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

rounds = int(sys.argv[1])
triton.set_allocator(sa._device_allocator)
cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), cfg, flush=True)
for D in (128, 64):
    for T, pad in ((2048, 0.0), (4096, 0.0), (8192, 0.0), (16384, 0.0), (4096, 0.25)):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, pad)
        q, k, v = (t.detach() for t in (q, k, v))
        B, H = q.shape[:2]
        fl = flops_fwd(H, D, L.tolist())
        tma = T >= 4096
        grid = (triton.cdiv(T, 128), B * H)
        fns, outs = {}, {}
        for name, kern in (("folded (new)", sa._sigmoid_fwd_kernel), ("before (old)", _fwd_old)):
            for rmax in (False, True):
                out = sa._empty_bthd_as_bhtd(q)
                mx = torch.zeros(B * H, triton.cdiv(T, 128), dtype=torch.float32, device="cuda")
                args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, mx.shape[1], 1 / math.sqrt(D), 0.0)
                kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=rmax, DOT_PRECISION="tf32",
                          TMA=tma, LOOKAHEAD=True, A_REGS=(D == 128 and tma), **cfg)
                n = f"{name} max={int(rmax)}"
                fns[n] = (lambda args=args, kw=kw: kern[grid](*args, **kw)); outs[n] = (out, mx)
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        o_new, m_new = outs["folded (new) max=1"]; o_old, m_old = outs["before (old) max=1"]
        same = torch.equal(o_new, o_old) and torch.equal(m_new, m_old)
        if pad == 0.0:
            def cud():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, k, v)
            fns["cudnn"] = cud
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            ts = sorted(times[n]); ms = ts[len(ts) // 2]
            print(f"D={D} T={T:5d} pad={pad:.2f} {n:20s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS  spread {(ts[-1]-ts[0])/ms:5.1%}  out+max bit-identical {same}", flush=True)
