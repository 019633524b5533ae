"""Session 6: does the masked-tail block cost the host-descriptor forward its lead? Direct launches,
one process, interleaved: the stand-alone kernel (hostdesc.py), the patch's production kernel with
its tail block (k_hd_tail.py) and without it (k_hd_notail.py, unpadded shapes only), the committed
kernel (in-kernel descriptors), cuDNN. hd 128, unpadded."""
import importlib, math, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor
sys.path.insert(0, ".dev/s6")
import hostdesc, k_hd_tail, k_hd_notail
from kernels.sweep_configs import inputs, runner
from stabilitylab.kernels.bench_attention import flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
D, rounds = 128, int(sys.argv[1])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)

def patched(mod, q, k, v, L, cfg):
    B, H, T, _ = q.shape
    bm, bn, w, s = cfg
    out = sa._empty_bthd_as_bhtd(q)
    mk = lambda t, blk: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, blk, D])
    args = sa._kernel_args((q, k, v, out), (sa._unused_f32(q.device),), L, H, T, 1, 1 / math.sqrt(D), 0.0)
    kw = dict(QD=mk(q, bm), KD=mk(k, bn), VD=mk(v, bn), HEAD_DIM=D, LOG_BIAS=True, SIGMOID=1, DOT_PRECISION="tf32",
              RETURN_MAX=False, TMA=True, LOOKAHEAD=True, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    grid = (triton.cdiv(T, bm), B * H)
    return (lambda: mod._sigmoid_fwd_kernel[grid](*args, **kw)), (out,)

for T in (4096, 8192, 16384):
    q, k, v, do, L = inputs(T, D, 0.0)
    fl = flops_fwd(q.shape[1], D, L.tolist())
    fns = {}
    for cfg in [(128, 64, 8, 3), (128, 64, 8, 4)]:
        c = "x".join(map(str, cfg))
        fns[f"committed {c}"] = runner("fwd", D, (True, True), cfg, (q, k, v, do, L))
        fn, o = hostdesc.host_runner(q, k, v, L, cfg, True); fns[f"stand-alone {c}"] = (fn, (o,))
        fns[f"patch, tail {c}"] = patched(k_hd_tail, q, k, v, L, cfg)
        fns[f"patch, no tail {c}"] = patched(k_hd_notail, q, k, v, L, cfg)
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    fns["cudnn"] = (cud, None)
    ref = None
    for n, (f, outs) in fns.items():
        f(); torch.cuda.synchronize()
        if outs is not None:
            ref = outs[0].float().clone() if ref is None else ref
            dev = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            if dev > 1e-3: print(f"T={T} {n}: rel dev {dev:.3g}")
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, (f, _) in fns.items():
            res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    for n in fns:
        ms = sorted(res[n])[len(res[n]) // 2]
        print(f"T={T:5d} {n:28s} {ms:.4f} ms {fl / ms * 1e-9:6.1f} TFLOPS  [{min(res[n]):.4f}, {max(res[n]):.4f}]", flush=True)
