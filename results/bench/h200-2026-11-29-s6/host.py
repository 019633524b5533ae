"""Session 6: host time of the op's forward with host-built TMA descriptors, and whether do_bench
sees it. GPU only; alone on the machine."""
import importlib, math, time
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor
from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
fast = sa._descriptor
checked = lambda t: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, t.shape[3]])

def host_us(fn, n=300):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n): fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt

B, H, T, D = 1, 2, 256, 128
q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
L = torch.tensor([T], device="cuda")
args = (L, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32, False)
for name, mk in (("fast desc", fast), ("checked desc", checked)):
    sa._descriptor = mk
    for tma in (True, False):
        f = lambda: sa.launch_forward(q, k, v, *args, tma=tma, lookahead=True)
        print(f"host launch_forward tma={int(tma)} {name:12s} {min(host_us(f) for _ in range(3)):7.1f} us/call", flush=True)
sa._descriptor = fast
print(f"host op (sigmoid_attention, T=256: no TMA) {min(host_us(lambda: sigmoid_attention(q, k, v, L)) for _ in range(3)):7.1f} us/call")

_sleep_buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
def ahead_ms(fn, n=40):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    st = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    en = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for i in range(n):
        _sleep_buf.zero_()
        torch.cuda._sleep(1_000_000)
        st[i].record(); fn(); en[i].record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in zip(st, en))
    return ts[n // 2]

for T in (4096, 8192):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, D, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    fl = flops_fwd(q.shape[1], D, L.tolist())
    out = sigmoid_attention(q, k, v, L)[0]
    tuned = next(t for (kern, *_), t in sa._TUNED.items() if kern is sa._sigmoid_fwd_kernel)
    best = next(iter(tuned._best.values()))
    print("tuned fwd config", best)
    o2 = sa._empty_bthd_as_bhtd(q)
    descs = sa._descriptors(True, QD=q, KD=k, VD=v)
    kw = dict(RETURN_MAX=False, TMA=True, LOOKAHEAD=True, **descs, **sa._common_args(D, q.dtype, True, sa.TANH_F32), **best)
    sa.set_blocks(kw)
    a = sa._kernel_args((q, k, v, o2), (sa._unused_f32(q.device),), L, q.shape[1], T, 1, 1 / math.sqrt(D), 0.0)
    grid = (triton.cdiv(T, best["BLOCK_M"]), q.shape[0] * q.shape[1])
    direct = lambda: sa._sigmoid_fwd_kernel[grid](*a, **kw)
    direct(); torch.cuda.synchronize()
    assert torch.equal(o2, out)
    def op_checked():
        sa._descriptor = checked
        r = sigmoid_attention(q, k, v, L)
        sa._descriptor = fast
        return r
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    fns = {"op": lambda: sigmoid_attention(q, k, v, L), "op checked desc": op_checked,
           "direct prebuilt desc": direct, "cudnn": cud}
    res = {n: ([], []) for n in fns}
    for _ in range(5):
        for n, f in fns.items():
            res[n][0].append(triton.testing.do_bench(f, warmup=25, rep=100))
            res[n][1].append(ahead_ms(f))
    for n in fns:
        b = sorted(res[n][0])[2]; g = sorted(res[n][1])[2]
        print(f"T={T} {n:22s} do_bench {b:.4f} ms {fl / b * 1e-9:6.0f} TFLOPS | ahead {g:.4f} ms {fl / g * 1e-9:6.0f}", flush=True)
