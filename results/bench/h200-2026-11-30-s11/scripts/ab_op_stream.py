"""Session 11: as ab_op.py, but GPU-bound: 30 calls back to back between two CUDA events (no cache
flush, the host far ahead), per arm, 9 interleaved rounds; ms per call, medians."""
import importlib, math, os, sys
import torch, triton
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_op import sa, old_forward, make_inputs, flops_fwd, F, SDPBackend, sdpa_kernel

def stream(f, n=30):
    f(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        f()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / n

out_dir, rounds = sys.argv[1], int(sys.argv[2])
triton.set_allocator(sa._device_allocator)
med = lambda xs: sorted(xs)[len(xs) // 2]
lines = []
for T in (1024, 4096, 8192, 16384):
    torch.manual_seed(0)
    q, k, v, L = make_inputs(T, 128, 0.0)
    q, k, v = (t.detach() for t in (q, k, v))
    fl = flops_fwd(q.shape[1], 128, L.tolist())
    args = (L, 1 / math.sqrt(128), 0.0, True, sa.TANH_F32, False, True)
    def cud():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v)
    fns = {"new": lambda: sa._forward_dense(q, k, v, *args)[0], "old": lambda: old_forward(q, k, v, L), "cudnn": cud}
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            times[n].append(stream(f))
    for n in fns:
        ts = times[n]
        r = [times["old"][i] / ts[i] for i in range(rounds)]
        c = [times["cudnn"][i] / ts[i] for i in range(rounds)]
        line = (f"T={T:5d} {n:6s} {fl / med(ts) * 1e-9:6.1f} TFLOPS  vs old {100 * (med(r) - 1):+5.1f}% [{100 * (min(r) - 1):+.1f}, {100 * (max(r) - 1):+.1f}]"
                f"  vs cudnn {100 * (med(c) - 1):+5.1f}%")
        print(line, flush=True); lines.append(line)
os.makedirs(out_dir, exist_ok=True)
open(f"{out_dir}/ab_op_stream.log", "w").write("\n".join(lines) + "\n")
