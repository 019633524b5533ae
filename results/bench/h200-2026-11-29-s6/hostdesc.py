"""Session 6 experiment: the forward with TMA descriptors built on the host (kernel arguments)
instead of in the kernel per program. Unpadded timing only (no per-sequence zero-fill).
Compares, interleaved: production kernel (in-kernel descriptors, TMA+LA; pointer loads + LA),
host-descriptor kernel (2D over contiguous B*H*T rows; rank-4 [B,H,T,D] with a reshape), cuDNN."""
import math, sys
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _fwd_host(Qd, Kd, Vd, Out, LENS, sob, soh, sot, H, T, scale,
              HEAD_DIM: tl.constexpr, RANK4: tl.constexpr, TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    a_s = 0.5 * scale
    c_s = -0.5 * tl.log(L.to(tl.float32))
    row0 = pid_bh * T
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if RANK4:
        q = Qd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        k0 = Kd.load([b, h, 0, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        q = Qd.load([row0 + start_m, 0])
        k0 = Kd.load([row0, 0])
    qk = tl.dot(q, tl.trans(k0))
    for start_n in range(0, L, BLOCK_N):
        n_k = start_n + BLOCK_N
        if RANK4:
            k = Kd.load([b, h, n_k, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = Vd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        else:
            k = Kd.load([row0 + n_k, 0])
            v = Vd.load([row0 + start_n, 0])
        qk_now = qk
        qk = tl.dot(q, tl.trans(k))
        x = qk_now * a_s + c_s
        if TANH:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
        else:
            t = 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0
        p = (0.5 * t + 0.5).to(v.dtype)
        acc = tl.dot(p, v, acc)
    acc = tl.where(offs_m[:, None] < L, acc, 0.0)
    tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)


def host_runner(q, k, v, lengths, cfg, rank4):
    import importlib
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
    B, H, T, D = q.shape
    bm, bn, w, s = cfg
    out = sa._empty_bthd_as_bhtd(q)
    if rank4:
        mk = lambda t, blk: TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, blk, D])
    else:
        mk = lambda t, blk: TensorDescriptor(t.view(B * H * T, D), [B * H * T, D], [D, 1], [blk, D])
    qd, kd, vd = mk(q, bm), mk(k, bn), mk(v, bn)
    grid = (triton.cdiv(T, bm), B * H)
    args = (qd, kd, vd, out, lengths, *out.stride()[:3], H, T, 1 / math.sqrt(D))
    kw = dict(HEAD_DIM=D, RANK4=rank4, TANH=q.is_cuda, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
    return (lambda: _fwd_host[grid](*args, **kw)), out


def main():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from stabilitylab.kernels.bench_attention import flops_fwd
    from kernels.sweep_configs import inputs, runner
    D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    cfgs = [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2)] if D == 128 else [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 2)]
    for T in (4096, 8192, 16384):
        q, k, v, do, lengths = inputs(T, D, 0.0)
        fl = flops_fwd(q.shape[1], D, lengths.tolist())
        fns = {}
        ref = None
        for cfg in cfgs:
            c = "x".join(map(str, cfg))
            fn, (o,) = runner("fwd", D, (True, True), cfg, (q, k, v, do, lengths)); fn(); torch.cuda.synchronize()
            ref = o.float().clone() if ref is None else ref
            fns[f"prod tma+la {c}"] = (fn, o)
            for r4 in (False, True):
                try:
                    fn, o = host_runner(q, k, v, lengths, cfg, r4); fn(); torch.cuda.synchronize()
                    fns[f"host{'4d' if r4 else '2d'} {c}"] = (fn, o)
                except Exception as e:
                    print(f"T={T} host r4={r4} {c}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        fn, (o,) = runner("fwd", D, (False, True), cfgs[0], (q, k, v, do, lengths))
        fns["prod ptr+la " + "x".join(map(str, cfgs[0]))] = (fn, o)
        def cud():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v)
        fns["cudnn"] = (cud, None)
        for n, (f, o) in fns.items():
            f(); torch.cuda.synchronize()
            if o is not None:
                dev = ((o.float() - ref).abs().max() / ref.abs().max()).item()
                if dev > 1e-3:
                    print(f"T={T} {n}: MISMATCH rel dev {dev:.3g}", flush=True)
        times = {n: [] for n in fns}
        for _ in range(5):
            for n, (f, _) in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=50))
        for n in fns:
            ts = sorted(times[n]); ms = ts[2]
            print(f"D={D} T={T:5d} {n:28s} {ms:.4f} ms {fl / ms * 1e-9:6.0f} TFLOPS  spread {(ts[-1]-ts[0])/ms:.1%}", flush=True)


if __name__ == "__main__":
    main()
