"""Session 7: the forward's key loop unrolled by two (pairs.py) vs not, vs the committed kernel,
vs cuDNN; direct launches, one process, interleaved rounds.   python3 pairs_ab.py ROUNDS"""
import importlib, math, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, ".dev/s7")
from pairs import _fwd_pairs
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

rounds = int(sys.argv[1])
triton.set_allocator(sa._device_allocator)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
for D in (128, 64):
    a_regs = D == 128
    for T in (4096, 8192, 16384):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, 0.0)
        q, k, v = (t.detach() for t in (q, k, v))
        B, H = q.shape[:2]
        fl = flops_fwd(H, D, L.tolist())
        fns, outs = {}, {}
        for stages in (2, 3, 4):
            cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=stages)
            grid = (triton.cdiv(T, 128), B * H)
            out = sa._empty_bthd_as_bhtd(q)
            mx = torch.zeros(1, dtype=torch.float32, device="cuda")
            args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
            kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
                      TMA=True, LOOKAHEAD=True, A_REGS=a_regs, **cfg)
            n = f"committed s{stages}"
            fns[n] = (lambda args=args, kw=kw, grid=grid: sa._sigmoid_fwd_kernel[grid](*args, **kw)); outs[n] = out
            for pairs in (0, 1):
                out = sa._empty_bthd_as_bhtd(q)
                args2 = (q, k, v, out, L, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], H, T, 1 / math.sqrt(D))
                kw2 = dict(HEAD_DIM=D, A_REGS=a_regs, PAIRS=bool(pairs), **cfg)
                n = f"trimmed pairs={pairs} s{stages}"
                fns[n] = (lambda args2=args2, kw2=kw2, grid=grid: _fwd_pairs[grid](*args2, **kw2)); outs[n] = out
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        fns["cudnn"] = cud
        for n in list(fns):
            try:
                fns[n]()
                torch.cuda.synchronize()
            except Exception as e:
                print(f"D={D} T={T} {n}: {type(e).__name__}", flush=True)
                del fns[n]
                outs.pop(n, None)
        o0 = outs["committed s3"]
        same = {n: torch.equal(o, o0) for n, o in outs.items()}
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            ts = sorted(times[n]); ms = ts[len(ts) // 2]
            print(f"D={D} T={T:5d} {n:22s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS  spread {(ts[-1]-ts[0])/ms:5.1%}  same-as-committed {same.get(n, '-')}", flush=True)
