"""Session 11: does the last, partly filled wave of tiles cost what it should? At T = 4K, hd 128 the
op's forward runs 32 query tiles per (b, h) and 64 (b, h): 2,048 tiles on 132 SMs, 15.5 waves,
so up to 3% of the time is a half-empty last wave. Vary B*H so the tiles fill 15.03 / 15.5 /
16.0 waves (BH = 62 / 64 / 66) and time the op and cuDNN, forward and backward, TFLOPS per valid
token. If the tail costs its share, TFLOPS(66) > TFLOPS(64) > TFLOPS(62) by ~3% each.
    python3 waves.py OUTDIR ROUNDS"""
import math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import flops_fwd

out_dir, rounds = sys.argv[1], int(sys.argv[2])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
for D, T, B, Hs in ((128, 4096, 2, (31, 32, 33)), (128, 8192, 1, (62, 64, 66)),
                    (64, 8192, 1, (62, 64, 66))):
    res = {}
    for H in Hs:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        L = torch.full((B,), T, dtype=torch.int32, device="cuda")
        fl = flops_fwd(H, D, L.tolist())
        out = sigmoid_attention(q, k, v, L)[0]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out_c = F.scaled_dot_product_attention(q, k, v)
        g = torch.randn_like(out)

        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)

        fns = {
            "op fwd": lambda: sigmoid_attention(q, k, v, L)[0],
            "cudnn fwd": cud,
            "op bwd": lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True),
            "cudnn bwd": lambda: torch.autograd.grad(out_c, (q, k, v), g, retain_graph=True),
        }
        for f in fns.values():
            f()
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            f_ = fl * (2.5 if "bwd" in n else 1.0)
            res[(n, H)] = f_ / med(times[n]) * 1e-9
        del q, k, v, out, out_c, g
        torch.cuda.empty_cache()
    for n in ("op fwd", "cudnn fwd", "op bwd", "cudnn bwd"):
        tf = [res[(n, H)] for H in Hs]
        line = (f"D={D} T={T} B={B} {n:10s} TFLOPS at BH={'/'.join(str(B * H) for H in Hs)}: "
                + " / ".join(f"{x:6.1f}" for x in tf)
                + f"   last vs middle {100 * (tf[2] / tf[1] - 1):+5.1f}%  first vs middle {100 * (tf[0] / tf[1] - 1):+5.1f}%")
        print(line, flush=True)
        lines.append(line)
os.makedirs(out_dir, exist_ok=True)
open(f"{out_dir}/waves.log", "w").write("\n".join(lines) + "\n")
