"""Session 8: why the production Q_TILES=4 kernel gained less than k_group.py's: direct launches at
128x64x8x3 (TMA, lookahead, A_REGS), one process, interleaved rounds.   python3 q4_variants.py OUT ROUNDS"""
import importlib, inspect, math, os, sys
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from k_group import _fwd_group
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

src = inspect.getsource(sa._sigmoid_fwd_kernel.fn)
LOOP = "for g in (tl.static_range if Q_TILES == 1 else tl.range)(0, Q_TILES):"
assert LOOP in src
gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
os.makedirs(gen, exist_ok=True)
with open(f"{gen}/k_prod_range.py", "w") as f:
    f.write("import triton\nimport triton.language as tl\n\n" +
            src.replace(LOOP, "for g in range(Q_TILES):").replace("def _sigmoid_fwd_kernel(", "def _fwd_range(") + "\n")
sys.path.insert(0, gen)
k_range = importlib.import_module("k_prod_range")._fwd_range

out_dir, rounds = sys.argv[1], int(sys.argv[2])
triton.set_allocator(sa._device_allocator)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
lines = []
D = 128
for T in (4096, 8192, 16384):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    B, H = q.shape[:2]
    fl = flops_fwd(H, D, L.tolist())
    fns, outs = {}, {}
    for name, kern, qt in (("prod q1", sa._sigmoid_fwd_kernel, 1), ("prod q4", sa._sigmoid_fwd_kernel, 4),
                           ("prod q4 range", k_range, 4), ("k_group q4", _fwd_group, 4)):
        out = sa._empty_bthd_as_bhtd(q)
        mx = torch.zeros(1, device="cuda")
        args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
        kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
                  TMA=True, LOOKAHEAD=True, A_REGS=True, Q_TILES=qt, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
        grid = (triton.cdiv(triton.cdiv(T, 128), qt), B * H)
        f = (lambda kern=kern, args=args, kw=kw, grid=grid: kern[grid](*args, **kw))
        f(); torch.cuda.synchronize()
        fns[name] = f; outs[name] = out
    same = {n: torch.equal(o, outs["prod q1"]) for n, o in outs.items()}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(triton.testing.do_bench(f, warmup=10, rep=50))
    for n in fns:
        ts = sorted(times[n]); ms = ts[len(ts) // 2]
        line = f"D={D} T={T:5d} {n:14s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS [{fl / ts[-1] * 1e-9:4.0f}, {fl / ts[0] * 1e-9:4.0f}] same {same[n]}"
        print(line, flush=True); lines.append(line)
with open(f"{out_dir}/q4_variants.log", "w") as f:
    f.write("\n".join(lines) + "\n")
