"""Session 11: the persistent dense forward on 132 programs (15.5 rounds of 2,048 tiles) vs on
128 (16 full rounds: the same number of rounds, 4 SMs idle, so more power for the others), through
the op's own launcher (``sa._forward_dense``; ``persistent_grid`` patched for the 132 arm; the committed one for the other), and cuDNN; hd 128,
unpadded, do_bench medians, interleaved rounds.   python3 ab_grid.py OUTDIR ROUNDS"""
import math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import importlib
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
REAL = sa.persistent_grid

out_dir, rounds = sys.argv[1], int(sys.argv[2])
N_SM = torch.cuda.get_device_properties(0).multi_processor_count
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "SMs", N_SM, flush=True)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
for T in (2048, 4096, 8192, 16384):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, 128, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    fl = flops_fwd(q.shape[1], 128, L.tolist())
    args = (L, 1 / math.sqrt(128), 0.0, True, sa.TANH_F32, False, True)
    n_tiles = triton.cdiv(T, 128) * q.shape[0] * q.shape[1]
    balanced = triton.cdiv(n_tiles, triton.cdiv(n_tiles, N_SM))
    def arm(n):
        def f():
            sa.persistent_grid = REAL if n == balanced else (lambda n_tiles, device: min(n_tiles, n))
            return sa._forward_dense(q, k, v, *args)[0]
        return f
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    fns = {f"P={N_SM}": arm(N_SM), f"P={balanced}": arm(balanced), "cudnn": cud}
    outs = {n: f() for n, f in fns.items()}
    same = torch.equal(outs[f"P={N_SM}"], outs[f"P={balanced}"])
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
    for n in fns:
        ts = times[n]
        r = [times[f"P={N_SM}"][i] / ts[i] for i in range(rounds)]
        c = [times["cudnn"][i] / ts[i] for i in range(rounds)]
        line = (f"T={T:5d} tiles={n_tiles} {n:6s} {fl / med(ts) * 1e-9:6.1f} TFLOPS  vs P={N_SM} {100 * (med(r) - 1):+5.1f}%"
                f" [{100 * (min(r) - 1):+.1f}, {100 * (max(r) - 1):+.1f}]  vs cudnn {100 * (med(c) - 1):+5.1f}%"
                f" [{100 * (min(c) - 1):+.1f}, {100 * (max(c) - 1):+.1f}]  same-output {same}")
        print(line, flush=True); lines.append(line)
os.makedirs(out_dir, exist_ok=True)
open(f"{out_dir}/ab_grid.log", "w").write("\n".join(lines) + "\n")
