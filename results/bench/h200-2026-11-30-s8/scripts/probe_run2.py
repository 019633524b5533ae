"""Session 8: per-tile clock probes of the forward with 1 and 4 query tiles per program (hd 128,
TMA, lookahead, A_REGS, 128x64x8x3).     python3 probe_run2.py OUTDIR"""
import importlib, math, os, sys
import numpy as np
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_gen2
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
os.makedirs(gen, exist_ok=True)
probe_gen2.generate(f"{gen}/k_probe2.py")
sys.path.insert(0, gen)
k_probe = importlib.import_module("k_probe2")._fwd_probe
out_dir = sys.argv[1]
triton.set_allocator(sa._device_allocator)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
rows = []
D = 128
for T in (4096, 16384):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    B, H = q.shape[:2]
    fl = flops_fwd(H, D, L.tolist())
    n_m = triton.cdiv(T, 128)
    for qt in (1, 4):
        out = sa._empty_bthd_as_bhtd(q)
        mx = torch.zeros(1, device="cuda")
        n_prog = triton.cdiv(n_m, qt)
        probe = torch.zeros(n_prog * qt * B * H, 8, dtype=torch.int64, device="cuda")
        args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
        args_p = args[:6] + (probe,) + args[6:]
        kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
                  TMA=True, LOOKAHEAD=True, A_REGS=True, Q_TILES=qt, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
        grid = (n_prog, B * H)
        plain = lambda: sa._sigmoid_fwd_kernel[grid](*args, **kw)
        probed = lambda: k_probe[grid](*args_p, **kw)
        plain(); probed(); torch.cuda.synchronize()
        t_plain = np.median([triton.testing.do_bench(plain, warmup=10, rep=50) for _ in range(3)])
        t_probe = np.median([triton.testing.do_bench(probed, warmup=10, rep=50) for _ in range(3)])
        probed(); torch.cuda.synchronize()
        p = probe.cpu().numpy().reshape(-1, qt, 8)
        g0, desc, pro, loop, epi, sm, g1 = (p[:, :, i] for i in range(7))
        n_iter = T // 64
        prog_start, prog_end = g0[:, 0], g1[:, -1]
        span = prog_end.max() - prog_start.min()
        dur = prog_end - prog_start
        gaps = []
        for s in np.unique(sm[:, 0]):
            idx = np.where(sm[:, 0] == s)[0]
            o = idx[np.argsort(prog_start[idx])]
            gaps += list(prog_start[o[1:]] - prog_end[o[:-1]])
        ghz = np.median((desc[:, 0] + (pro + loop + epi).sum(1)) / np.maximum(dur, 1))
        lines = [f"T={T} Q_TILES={qt}: plain {t_plain:.4f} ms ({fl / t_plain * 1e-9:.0f} TFLOPS), probed {t_probe:.4f} ms; "
                 f"span {span / 1e3:.1f} us; program {np.median(dur) / 1e3:.2f} us; clock ~{ghz:.2f} GHz; "
                 f"gap between programs on an SM median {np.median(gaps):.0f} ns",
                 f"   program start to first tile (q4: the descriptors) {np.median(desc[:, 0]):.0f} cyc; per tile (median): "
                 f"prologue {np.median(pro):.0f} cyc (tile 0 {np.median(pro[:, 0]):.0f}, later {np.median(pro[:, 1:]) if qt > 1 else float('nan'):.0f}), "
                 f"loop {np.median(loop) / n_iter:.0f}/iter (tile 0 {np.median(loop[:, 0]) / n_iter:.0f}, last {np.median(loop[:, -1]) / n_iter:.0f}), "
                 f"epilogue {np.median(epi):.0f} cyc",
                 f"   cycles per tile, all in: {np.median(dur) * ghz / qt:.0f} (loop alone {np.median(loop):.0f})"]
        for l in lines:
            print(l, flush=True)
        rows += lines
        np.save(f"{out_dir}/probe2_T{T}_q{qt}.npy", p)
with open(f"{out_dir}/probe2.log", "w") as f:
    f.write("\n".join(rows) + "\n")
