import cProfile, pstats, io, math, time, importlib
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.triton_support import seq_bucket
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
from kernels.sweep_configs import runner

def host_us(fn, n=300):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt

B, H, T, D = 1, 2, 256, 128
q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
L = torch.tensor([T], device="cuda")
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
args = (L, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32, False)
jit_fwd, _ = runner("fwd", D, (False, True), (128, 64, 8, 3), (q, k, v, do, L))
jit_dq, _ = runner("dq", D, (False, False), (128, 64, 8, 3), (q, k, v, do, L))
out = sigmoid_attention(qg, kg, vg, L)[0]
fns = {
  "jit fwd (explicit config)": jit_fwd,
  "jit dq (explicit config)": jit_dq,
  "launch_forward ptr+la": lambda: sa.launch_forward(q, k, v, *args, tma=False, lookahead=True),
  "forward_auto": lambda: sa.forward_auto(q, k, v, *args),
  "op no grad": lambda: sigmoid_attention(q, k, v, L),
  "op with grad": lambda: sigmoid_attention(qg, kg, vg, L),
  "launch_backward": lambda: sa.launch_backward(do, q, k, v, *args[:-1], tma_dq=False, tma_dkdv=False, lookahead=False),
  "autograd.grad op": lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True),
}
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    oc = F.scaled_dot_product_attention(qg, kg, vg)
    fns["cudnn fwd"] = lambda: F.scaled_dot_product_attention(qg, kg, vg)
    fns["cudnn autograd.grad"] = lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True)
    for n, f in fns.items():
        print(f"{n:28s} host {host_us(f):7.1f} us/call", flush=True)
for name in ("launch_forward ptr+la", "autograd.grad op"):
    f = fns[name]
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): f()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"==== {name}: cProfile (300 calls), by tottime"); print(s.getvalue()[-5000:])
