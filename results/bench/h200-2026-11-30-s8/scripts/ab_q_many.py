"""Session 8: the op's forward at head dim 128 with 4 vs 1 query tiles per program, and the same
kernel launched directly at the op's config, vs SDPA cuDNN; many interleaved rounds; per-round
ratios.       python3 ab_q_many.py OUTDIR ROUNDS"""
import importlib, math, statistics, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
out_dir, rounds = sys.argv[1], int(sys.argv[2])
triton.set_allocator(sa._device_allocator)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)


def with_tiles(n, f):
    def g():
        sa.FWD_Q_TILES = n
        try:
            return f()
        finally:
            sa.FWD_Q_TILES = 4
    return g


lines = []
D = 128
for T in (4096, 8192, 16384):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    B, H = q.shape[:2]
    fl = flops_fwd(H, D, L.tolist())
    fwd = lambda: sa.sigmoid_attention(q, k, v, L)
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    fns = {"op q4": with_tiles(4, fwd), "op q1": with_tiles(1, fwd), "cudnn": cud}
    for qt in (4, 1):
        o = sa._empty_bthd_as_bhtd(q)
        mx = torch.zeros(1, device="cuda")
        args = sa._kernel_args((q, k, v, o), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
        kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
                  TMA=True, LOOKAHEAD=True, A_REGS=True, Q_TILES=qt, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
        grid = (triton.cdiv(triton.cdiv(T, 128), qt), B * H)
        fns[f"direct q{qt}"] = (lambda args=args, kw=kw, grid=grid: sa._sigmoid_fwd_kernel[grid](*args, **kw))
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            res[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
    for n in fns:
        ms = statistics.median(res[n])
        line = f"D={D} T={T:5d} {n:10s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS [{fl / max(res[n]) * 1e-9:4.0f}, {fl / min(res[n]) * 1e-9:4.0f}]"
        print(line, flush=True); lines.append(line)
    for a, b in (("op q4", "op q1"), ("direct q4", "direct q1"), ("op q4", "cudnn"), ("op q1", "cudnn")):
        r = sorted(y / x - 1 for x, y in zip(res[a], res[b]))  # speed ratio a over b, per round
        line = (f"D={D} T={T:5d} {a} vs {b}: median per-round gain {statistics.median(r):+.1%} "
                f"[{r[0]:+.1%}, {r[-1]:+.1%}], a faster in {sum(x > 0 for x in r)}/{len(r)} rounds")
        print(line, flush=True); lines.append(line)
with open(f"{out_dir}/ab_q_many.log", "w") as f:
    f.write("\n".join(lines) + "\n")
