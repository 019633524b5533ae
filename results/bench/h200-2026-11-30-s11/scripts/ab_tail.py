"""Session 11: the dense forward with its last round split by keys (working tree) vs the same
kernel before (HEAD, .dev/s11/old_dense.py), same fixed config, direct launches; plus the op
(autotuned) and cuDNN. hd 128, unpadded, interleaved rounds, do_bench medians.
    python3 ab_tail.py OUTDIR ROUNDS"""
import importlib, importlib.util, math, os, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
sd = importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")
spec = importlib.util.spec_from_file_location("old_dense", os.path.join(os.path.dirname(os.path.abspath(__file__)), "old_dense.py"))
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
from stabilitylab.kernels.triton_support import autotune_choices

N_SM = torch.cuda.get_device_properties(0).multi_processor_count


def launch(which, q, k, v, L, cfg):
    B, H, T, D = q.shape
    out = sa._empty_bthd_as_bhtd(q)
    mx = sa._unused_f32(q.device)
    desc = sd.descriptors(Q=q, K=k, V=v)
    sd.set_blocks({**desc, **cfg})
    n_m = triton.cdiv(T, cfg["BLOCK_M"]); n_k = triton.cdiv(T, cfg["BLOCK_N"])
    P = min(N_SM, n_m * B * H)
    kw = dict(HEAD_DIM=D, LOG_BIAS=True, SIGMOID=sa.TANH_F32, RETURN_MAX=False, DOT_PRECISION="tf32",
              A_REGS=True, **desc, **cfg)
    scale = 1 / math.sqrt(D)
    if which == "old":
        old._sigmoid_fwd_dense_kernel[(P,)](out, mx, L, *out.stride()[:3], H, T, sa.seq_bucket(T), 1, scale, 0.0, B * H, **kw)
        return out
    part = torch.empty(N_SM * 2 * cfg["BLOCK_M"] * D, dtype=torch.float32, device=q.device)
    part_mx = torch.empty(N_SM * 2, dtype=torch.float32, device=q.device)
    sd._sigmoid_fwd_dense_kernel[(P,)](out, mx, part, part_mx, L, *out.stride()[:3], H, T, sa.seq_bucket(T), 1, scale, 0.0, B * H, **kw)
    n_full, tail, run = sd.tail_split(n_m * B * H, n_k, P)
    if tail:
        sd._sigmoid_fwd_dense_tail_kernel[(tail,)](out, mx, part, part_mx, *out.stride()[:3], H, T, 1, scale, n_full, run, n_k,
                                                   HEAD_DIM=D, RETURN_MAX=False, BLOCK_M=cfg["BLOCK_M"], num_warps=4)
    return out


if __name__ == "__main__":
    out_dir, rounds = sys.argv[1], int(sys.argv[2])
    triton.set_allocator(sa._device_allocator)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name(), "SMs", N_SM, flush=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    lines = []
    cfgs = {"128x64x8x3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
            "128x64x4x3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)}
    for T in (4096, 8192, 16384):
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, 128, 0.0)
        q, k, v = (t.detach() for t in (q, k, v))
        fl = flops_fwd(q.shape[1], 128, L.tolist())
        fns = {"op": lambda: sa.sigmoid_attention(q, k, v, L)[0]}
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        fns["cudnn"] = cud
        outs = {"op": fns["op"]()}
        for cn, cfg in cfgs.items():
            for which in ("old", "new"):
                n = f"{which} {cn}"
                f = (lambda which=which, cfg=cfg: launch(which, q, k, v, L, cfg))
                try:
                    outs[n] = f(); torch.cuda.synchronize()
                except Exception as e:
                    print(f"T={T} {n}: {type(e).__name__} {str(e)[:200]}", flush=True); continue
                fns[n] = f
        diffs = {n: float((o.float() - outs["op"].float()).abs().max()) for n, o in outs.items()}
        for cn in cfgs:
            if f"old {cn}" in outs and f"new {cn}" in outs:
                d = (outs[f"old {cn}"].float() - outs[f"new {cn}"].float()).abs()
                print(f"T={T} {cn}: new vs old max|diff| {float(d.max()):.3g}, rows differing {int((d.amax(-1) > 0).sum())}", flush=True)
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            ts = times[n]
            vs_c = med([times["cudnn"][i] / ts[i] for i in range(rounds)])
            on = n.replace("new", "old")
            vs_old = med([times[on][i] / ts[i] for i in range(rounds)]) if n.startswith("new") and on in times else float("nan")
            line = (f"T={T:5d} {n:14s} {fl / med(ts) * 1e-9:6.1f} TFLOPS  vs cudnn {100 * (vs_c - 1):+5.1f}%"
                    f"  new vs old {100 * (vs_old - 1):+5.1f}%  max|diff| vs op {diffs.get(n, float('nan')):.3g}")
            print(line, flush=True); lines.append(line)
        del q, k, v
        torch.cuda.empty_cache()
    print(autotune_choices(sa._TUNED))
    os.makedirs(out_dir, exist_ok=True)
    open(f"{out_dir}/ab_tail.log", "w").write("\n".join(lines) + "\n")
