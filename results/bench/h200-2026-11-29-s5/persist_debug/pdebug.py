import importlib, math, sys
import torch, triton
sys.path.insert(0, ".dev")
import persist
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
triton.set_allocator(sa._device_allocator)
for T in (4096, 8192):
    D = 128
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    B, H = q.shape[:2]
    fl = flops_fwd(H, D, [T] * B)
    ref = sigmoid_attention(q, k, v, L)[0]
    e_fn, e_out = persist.runner(D, (1, 1), (128, 64, 8, 3), 1, (q, k, v, L))
    def integ(pers, cfg=(128, 64, 8, 3)):
        out = sa._empty_bthd_as_bhtd(q)
        mx = sa._unused_f32(q.device)
        bm, bn, w, s = cfg
        n_m = triton.cdiv(T, bm)
        grid = (min(n_m * B * H, 132),) if pers else (n_m, B * H)
        args = sa._kernel_args((q, k, v, out), (mx,), L, H, T, 1, B * H, 1 / math.sqrt(D), 0.0)
        kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=1, DOT_PRECISION="tf32", RETURN_MAX=False, TMA=True,
                  LOOKAHEAD=True, PERSISTENT=pers, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        return (lambda: sa._sigmoid_fwd_kernel[grid](*args, **kw)), out
    fns = {"experimental persistent": (e_fn, e_out), "integrated persistent": integ(True), "integrated grid": integ(False),
           "op": (lambda: sigmoid_attention(q, k, v, L), None)}
    for n, (f, o) in fns.items():
        f(); torch.cuda.synchronize()
        if o is not None:
            print(n, "rel dev", ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item())
    times = {n: [] for n in fns}
    for _ in range(5):
        for n, (f, _) in fns.items():
            times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
    for n in fns:
        ms = sorted(times[n])[2]
        print(f"T={T} {n:26s} {ms:.4f} ms {fl / ms * 1e-9:.0f} TFLOPS")
    for key, t in sa._TUNED.items():
        print(key[0].__name__ if hasattr(key[0], "__name__") else key[0], t._best)
k = sa._sigmoid_fwd_kernel
