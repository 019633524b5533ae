"""Session 5 diagnostic: the bar shapes timed as the bar does (do_bench: host time before the first
launch counts when the GPU waits) and with the GPU kept ahead of the host (a sleep kernel before each call), op and SDPA cuDNN; then host
time per call. GPU only; run alone on the machine."""
import math, sys, time, importlib
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
_cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")


def ahead_ms(fn, n=40):
    """do_bench's method (L2 flush, then events around fn) with the GPU kept busy by a sleep kernel
    while the host prepares fn's launches: GPU time without host gaps."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        _cache.zero_()
        torch.cuda._sleep(1_000_000)  # ~0.5 ms at 1.98 GHz: the host queues fn meanwhile
        st[i].record()
        fn()
        en[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(st, en))
    return ts[n // 2]
rows = []
for D, T, pad in [(d, t, 0.0) for d in (64, 128) for t in (4096, 8192, 16384)] + [(128, 4096, 0.25), (128, 16384, 0.25), (64, 8192, 0.25)]:
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, pad)
        B, H = q.shape[:2]
        fl = flops_fwd(H, D, L.tolist())
        do = torch.randn_like(q)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        o = sigmoid_attention(q, k, v, L)[0]
        print("persistent:", getattr(sa, "use_persistent", lambda *a: "n/a")(q, L), flush=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(q, k, v)
        def cud_f():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qd, kd, vd)
        fns = {
            "op fwd": lambda: sigmoid_attention(qd, kd, vd, L),
            "op bwd": lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True),
            "cudnn fwd": cud_f,
            "cudnn bwd": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True),
        }
        res = {n: {"bench": [], "graph": []} for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                res[n]["bench"].append(triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median"))
                res[n]["graph"].append(float("nan"))
        med = lambda xs: sorted(xs)[len(xs) // 2]
        for n in fns:
            mult = 2.5 if "bwd" in n else 1.0
            b, g = med(res[n]["bench"]), med(res[n]["graph"])
            rows.append((D, T + pad, n, b, g, mult * fl / b * 1e-9, mult * fl / g * 1e-9))
        print(f"D={D} T={T} pad={pad} done", flush=True)
print(f"\n{'D':>4} {'T':>6} {'what':16s} {'do_bench ms':>11} {'ahead ms':>9} {'TFLOPS bench':>12} {'TFLOPS ahead':>12}")
for D, T, n, b, g, tb, tg in rows:
    print(f"{D:4d} {T:8.2f} {n:16s} {b:11.4f} {g:9.4f} {tb:12.1f} {tg:12.1f}")
# host time per call (queued without a sync), small shape: the wrapper, not the kernel
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
out = sigmoid_attention(qg, kg, vg, L)[0]
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    oc = F.scaled_dot_product_attention(qg, kg, vg)
    hf = {
        "op no grad": lambda: sigmoid_attention(q, k, v, L),
        "op with grad": lambda: sigmoid_attention(qg, kg, vg, L),
        "backward_auto": lambda: sa.backward_auto(do, q, k, v, L, 0.088, 0.0, True, sa.TANH_F32),
        "autograd.grad op": lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True),
        "cudnn fwd": lambda: F.scaled_dot_product_attention(qg, kg, vg),
        "cudnn autograd.grad": lambda: torch.autograd.grad(oc, (qg, kg, vg), do, retain_graph=True),
    }
    print()
    for n, f in hf.items():
        print(f"host {n:22s} {host_us(f):7.1f} us/call", flush=True)
