"""Session 6: why did the stand-alone host-descriptor forward beat the production kernel (calls 2-3)
while the op with host descriptors lost to the op as it was (call 7)? One process, interleaved:
the op (in-kernel descriptors, committed), the production kernel launched directly (sweep runner)
at two configs, the stand-alone host-descriptor kernel at the same configs, cuDNN. hd 128."""
import importlib, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, ".dev/s6")
import hostdesc
from kernels.sweep_configs import inputs, runner
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
D, rounds = 128, int(sys.argv[1])
print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), flush=True)
for T in (4096, 8192, 16384):
    q, k, v, do, L = inputs(T, D, 0.0)
    fl = flops_fwd(q.shape[1], D, L.tolist())
    ref = sigmoid_attention(q, k, v, L)[0].float()
    best = next(iter(next(t for (kern, *_), t in sa._TUNED.items() if kern is sa._sigmoid_fwd_kernel)._best.values()))
    fns = {"op": (lambda: sigmoid_attention(q, k, v, L), None)}
    for cfg in [(128, 64, 8, 3), (128, 64, 8, 4)]:
        c = "x".join(map(str, cfg))
        fns[f"prod direct {c}"] = runner("fwd", D, (True, True), cfg, (q, k, v, do, L))
        fn, o = hostdesc.host_runner(q, k, v, L, cfg, True)
        fns[f"hostdesc4d {c}"] = (fn, (o,))
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    fns["cudnn"] = (cud, None)
    for n, (f, outs) in fns.items():
        f(); torch.cuda.synchronize()
        if outs is not None:
            dev = ((outs[0].float() - ref).abs().max() / ref.abs().max()).item()
            if dev > 1e-3: print(f"T={T} {n}: rel dev {dev:.3g}")
    res = {n: [] for n in fns}
    for _ in range(rounds):
        for n, (f, _) in fns.items():
            res[n].append(triton.testing.do_bench(f, warmup=25, rep=100))
    print(f"T={T} op config {best}")
    for n in fns:
        ms = sorted(res[n])[len(res[n]) // 2]
        print(f"T={T:5d} {n:24s} {ms:.4f} ms {fl / ms * 1e-9:6.1f} TFLOPS  [{min(res[n]):.4f}, {max(res[n]):.4f}]", flush=True)
