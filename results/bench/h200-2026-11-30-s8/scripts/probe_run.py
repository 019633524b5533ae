"""Session 8: where does a forward program's time go? Runs the instrumented copy of the committed
forward (probe_gen.py) at the op's config and prints per-program prologue / loop / epilogue cycles,
the gaps between programs on one SM, and the wave structure.   python3 probe_run.py OUTDIR"""
import importlib, math, os, sys
import numpy as np
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe_gen
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd

gen = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gen")
os.makedirs(gen, exist_ok=True)
probe_gen.generate(f"{gen}/k_probe.py")
sys.path.insert(0, gen)
k_probe = importlib.import_module("k_probe")._fwd_probe

out_dir = sys.argv[1]
triton.set_allocator(sa._device_allocator)
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
rows = []
for D, T, stages, a_regs in ((128, 4096, 3, True), (128, 16384, 3, True), (64, 4096, 3, False), (64, 16384, 3, False)):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    B, H = q.shape[:2]
    fl = flops_fwd(H, D, L.tolist())
    cfg = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=stages)
    n_m = triton.cdiv(T, 128)
    out = sa._empty_bthd_as_bhtd(q)
    out2 = sa._empty_bthd_as_bhtd(q)
    mx = torch.zeros(1, dtype=torch.float32, device="cuda")
    probe = torch.zeros(n_m * B * H, 10, dtype=torch.int64, device="cuda")
    kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
              TMA=True, LOOKAHEAD=True, A_REGS=a_regs, **cfg)
    args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
    args2 = sa._kernel_args((q, k, v, out2), (mx,), L, H, T, 1, 1 / math.sqrt(D), 0.0)
    args_p = args2[:6] + (probe,) + args2[6:]
    grid = (n_m, B * H)
    plain = lambda: sa._sigmoid_fwd_kernel[grid](*args, **kw)
    probed = lambda: k_probe[grid](*args_p, **kw)
    plain(); probed(); torch.cuda.synchronize()
    same = torch.equal(out, out2)
    t_plain = [triton.testing.do_bench(plain, warmup=10, rep=50) for _ in range(3)]
    t_probe = [triton.testing.do_bench(probed, warmup=10, rep=50) for _ in range(3)]
    # one clean probed run after a flush-like idle
    torch.cuda.synchronize(); probed(); torch.cuda.synchronize()
    p = probe.cpu().numpy()
    g0, g1, pro, loop, epi, sm = p[:, 0], p[:, 1], p[:, 2], p[:, 3], p[:, 4], p[:, 5]
    span_ns = g1.max() - g0.min()
    dur = g1 - g0
    cyc = pro + loop + epi
    ghz = np.median(cyc / np.maximum(dur, 1))
    n_iter = T // 64
    # gaps between consecutive programs on each SM
    gaps, per_sm = [], []
    for s in np.unique(sm):
        idx = np.where(sm == s)[0]
        o = idx[np.argsort(g0[idx])]
        gaps += list(g0[o[1:]] - g1[o[:-1]])
        per_sm.append(len(o))
    gaps = np.array(gaps)
    busy = float(dur.sum()) / (len(np.unique(sm)) * float(span_ns))
    name = f"D={D} T={T} s{stages} aregs={int(a_regs)}"
    lines = [
        f"{name}: same={same} plain {np.median(t_plain):.4f} ms ({fl / np.median(t_plain) * 1e-9:.0f} TFLOPS), "
        f"probed {np.median(t_probe):.4f} ms; one probed run spans {span_ns / 1e3:.1f} us over {len(np.unique(sm))} SMs, "
        f"programs per SM {min(per_sm)}-{max(per_sm)}, SM busy fraction {busy:.3f}, clock ~{ghz:.2f} GHz",
        f"   per program (median [p10, p90]): total {np.median(dur) / 1e3:.2f} us [{np.percentile(dur, 10) / 1e3:.2f}, {np.percentile(dur, 90) / 1e3:.2f}]; "
        f"prologue {np.median(pro):.0f} cyc [{np.percentile(pro, 10):.0f}, {np.percentile(pro, 90):.0f}], "
        f"loop {np.median(loop):.0f} cyc = {np.median(loop) / n_iter:.0f}/iter [{np.percentile(loop, 10) / n_iter:.0f}, {np.percentile(loop, 90) / n_iter:.0f}], "
        f"epilogue {np.median(epi):.0f} cyc [{np.percentile(epi, 10):.0f}, {np.percentile(epi, 90):.0f}]",
        f"   gap between programs on an SM: median {np.median(gaps):.0f} ns [p10 {np.percentile(gaps, 10):.0f}, p90 {np.percentile(gaps, 90):.0f}], "
        f"first start spread {(np.sort(g0)[131] - g0.min()) / 1e3:.2f} us, last end spread {(g1.max() - np.sort(g1)[-132]) / 1e3:.2f} us",
    ]
    # first-wave programs vs later ones
    first = np.argsort(g0)[:132]
    later = np.argsort(g0)[132:]
    lines.append(f"   first wave: prologue {np.median(pro[first]):.0f} cyc, loop/iter {np.median(loop[first]) / n_iter:.0f}; "
                 f"later: prologue {np.median(pro[later]):.0f} cyc, loop/iter {np.median(loop[later]) / n_iter:.0f}")
    sub = p[:, 6:10]
    lines.append("   prologue parts (median cyc): descriptors %.0f, q load %.0f, k0 load %.0f, first q k^T %.0f" % tuple(np.median(sub, axis=0)))
    for l in lines:
        print(l, flush=True)
    rows += lines
    np.save(f"{out_dir}/probe_D{D}_T{T}_s{stages}_a{int(a_regs)}.npy", p)
with open(f"{out_dir}/probe.log", "w") as f:
    f.write("\n".join(rows) + "\n")
