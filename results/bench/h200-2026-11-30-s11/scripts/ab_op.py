"""Session 11: the op's dense forward with the last round split by keys (``sa._forward_dense``, the
working tree) vs the same host path with HEAD's kernel (one Tuned autotuner over the same configs,
straight launches, no tail kernel), and cuDNN; hd 128, unpadded, T = 1K-16K, interleaved rounds.
    python3 ab_op.py OUTDIR ROUNDS"""
import importlib, importlib.util, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
sd = importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")
spec = importlib.util.spec_from_file_location("old_dense", os.path.join(os.path.dirname(os.path.abspath(__file__)), "old_dense.py"))
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
from stabilitylab.kernels.triton_support import Tuned, capability

N_SM = torch.cuda.get_device_properties(0).multi_processor_count
OLD = {}


def old_forward(q, k, v, L):
    B, H, T, D = q.shape
    out = sa._empty_bthd_as_bhtd(q)
    mx, n_mx = sa._max_buffer(q, False)
    grid = lambda meta: (min(N_SM, triton.cdiv(T, meta["BLOCK_M"]) * B * H),)
    args = (out, mx, L, *out.stride()[:3], H, T, sa.seq_bucket(T), n_mx, 1 / math.sqrt(D), 0.0, B * H)
    kwargs = {"RETURN_MAX": False, **sd.descriptors(Q=q, K=k, V=v),
              **sa._common_args(D, q.dtype, True, sa.TANH_F32, True)}
    key = (sa.seq_bucket(T), D, sa.TANH_F32, True, q.dtype)
    if key not in OLD:
        OLD[key] = Tuned(old._sigmoid_fwd_dense_kernel, sa._configs("fwd", capability(q.device), False, True),
                         ["T_BUCKET", "HEAD_DIM", "SIGMOID", "A_REGS"])
    OLD[key].launch(grid, key, *args, **kwargs)
    return out


if __name__ == "__main__":
    out_dir, rounds = sys.argv[1], int(sys.argv[2])
    triton.set_allocator(sa._device_allocator)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "SMs", N_SM, flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    lines = []
    for T in (1024, 2048, 4096, 8192, 16384):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, 128, 0.0)
        q, k, v = (t.detach() for t in (q, k, v))
        fl = flops_fwd(q.shape[1], 128, L.tolist())
        args = (L, 1 / math.sqrt(128), 0.0, True, sa.TANH_F32, False, True)
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        fns = {"new (split tail)": lambda: sa._forward_dense(q, k, v, *args)[0],
               "old (round-robin)": lambda: old_forward(q, k, v, L), "cudnn": cud}
        a, b = fns["new (split tail)"](), fns["old (round-robin)"]()
        d = float((a.float() - b.float()).abs().max())
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            ts = times[n]
            vs_c = med([times["cudnn"][i] / ts[i] for i in range(rounds)])
            vs_o = med([times["old (round-robin)"][i] / ts[i] for i in range(rounds)])
            lo = min(times["old (round-robin)"][i] / ts[i] for i in range(rounds))
            hi = max(times["old (round-robin)"][i] / ts[i] for i in range(rounds))
            line = (f"T={T:5d} {n:18s} {fl / med(ts) * 1e-9:6.1f} TFLOPS  vs cudnn {100 * (vs_c - 1):+5.1f}%"
                    f"  vs old {100 * (vs_o - 1):+5.1f}% [{100 * (lo - 1):+.1f}, {100 * (hi - 1):+.1f}]  new-old max|diff| {d:.3g}")
            print(line, flush=True); lines.append(line)
        del q, k, v
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    open(f"{out_dir}/ab_op.log", "w").write("\n".join(lines) + "\n")
