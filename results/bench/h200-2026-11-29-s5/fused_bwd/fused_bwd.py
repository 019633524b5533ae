"""Session 5 experiment (not the lab's kernel): a fused backward over key tiles that also adds each
tile pair's dQ share into a float32 buffer with atomics (5 matrix products per tile pair instead of
the split design's 7). Question for issue 3's filer: would allowing dQ atomics meet the hd-128
backward bar? GPU: python3 .dev/fused_bwd.py OUT; CPU check: TRITON_INTERPRET=1 python3 .dev/fused_bwd.py --check"""
import importlib, itertools, math, os, sys
import torch, triton, triton.language as tl


@triton.jit
def _bwd_fused(Q, K, V, DO, DQA, DK, DV, LENS,
               sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
               sdab, sdah, sdat, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, T, scale,
               HEAD_DIM: tl.constexpr, SIGMOID: tl.constexpr, TMA: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h * sqh
    do_base = DO + b64 * sdob + h * sdoh
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    dqa_base = DQA + b64 * sdab + h * sdah
    bias_b = -tl.log(L.to(tl.float32))
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    if start_n < L:
        if TMA:
            q_desc = tl.make_tensor_descriptor(q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM])
            do_desc = tl.make_tensor_descriptor(do_base, shape=[L, HEAD_DIM], strides=[sdot, 1], block_shape=[BLOCK_M, HEAD_DIM])
        key_mask = offs_n[:, None] < L
        k = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :], mask=key_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svt + offs_d[None, :], mask=key_mask, other=0.0)
        for start_m in range(0, L, BLOCK_M):
            rows_m = start_m + offs_m
            if TMA:
                q = q_desc.load([start_m, 0])
                do = do_desc.load([start_m, 0])
            else:
                q = tl.load(q_base + rows_m[:, None] * sqt + offs_d[None, :], mask=rows_m[:, None] < L, other=0.0)
                do = tl.load(do_base + rows_m[:, None] * sdot + offs_d[None, :], mask=rows_m[:, None] < L, other=0.0)
            dp_t = tl.dot(v, tl.trans(do))
            s_t = tl.dot(k, tl.trans(q))
            x_t = s_t * a_s + c_s
            if SIGMOID == 0:
                p_t = 1.0 / (1.0 + tl.exp(-x_t))
                ds_t = 4.0 * (p_t - p_t * p_t) * dp_t
            else:
                t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x_t], dtype=tl.float32, is_pure=True, pack=1)
                p_t = 0.5 * t + 0.5
                ds_t = (1.0 - t * t) * dp_t
            ds16 = ds_t.to(q.dtype)
            dv = tl.dot(p_t.to(do.dtype), do, dv)
            dk = tl.dot(ds16, q, dk)
            dq_part = tl.dot(tl.trans(ds16), k)  # (BLOCK_M, D): this key tile's share of dQ
            tl.atomic_add(dqa_base + rows_m[:, None] * sdat + offs_d[None, :], dq_part,
                          mask=rows_m[:, None] < L, sem="relaxed")
    valid = offs_n[:, None] < L
    in_range = offs_n[:, None] < T
    tl.store(DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
             tl.where(valid, dk * (0.25 * scale), 0.0).to(DK.dtype.element_ty), mask=in_range)
    tl.store(DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
             tl.where(valid, dv, 0.0).to(DV.dtype.element_ty), mask=in_range)


def fused_backward(do, q, k, v, lengths, cfg, tma, sigmoid):
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
    B, H, T, D = q.shape
    bm, bn, w, s = cfg
    if tma and os.environ.get("TRITON_INTERPRET") != "1":
        triton.set_allocator(sa._device_allocator)
    dqa = torch.zeros(B, H, T, D, dtype=torch.float32, device=q.device)
    dk, dv = sa._empty_bthd_as_bhtd(k), sa._empty_bthd_as_bhtd(v)
    st = [x for t in (q, k, v, do, dqa, dk, dv) for x in t.stride()[:3]]
    scale = 1 / math.sqrt(D)
    kw = dict(HEAD_DIM=D, SIGMOID=sigmoid, TMA=tma, BLOCK_M=bm, BLOCK_N=bn)
    if os.environ.get("TRITON_INTERPRET") != "1":
        kw.update(num_warps=w, num_stages=s)
    _bwd_fused[(triton.cdiv(T, bn), B * H)](q, k, v, do, dqa, dk, dv, lengths, *st, H, T, scale, **kw)
    dq = (dqa * (0.25 * scale)).to(q.dtype)
    return dq, dk, dv


def check_cpu():
    from stabilitylab.kernels.reference import sigmoid_attention_reference
    torch.manual_seed(0)
    for D in (64, 128):
        B, H, T = 2, 2, 45
        q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
        lengths = torch.tensor([45, 20], dtype=torch.int32)
        out = sigmoid_attention_reference(q, k, v, lengths)
        do = torch.randn_like(out)
        mask = (torch.arange(T)[None, :] < lengths[:, None])[:, None, :, None]
        do = do * mask
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), do)
        f = lambda t: t.detach().float()
        dq, dk, dv = fused_backward(f(do), f(q), f(k), f(v), lengths, (16, 16, 4, 1), False, 0)
        for n, a, r in (("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
            err = ((a.double() - r) * mask).abs().max().item() / r.abs().max().item()
            print(D, n, f"rel err {err:.2e}")
            assert err < 1e-4, (D, n, err)
    print("cpu check ok")


def gpu(out):
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")
    from stabilitylab.kernels.bench_attention import make_inputs, flops_fwd
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    variants = {128: [((64, 128, 8, 3), True), ((64, 128, 8, 3), False), ((64, 128, 8, 2), True),
                      ((32, 128, 4, 3), True)],
                64: [((64, 128, 8, 3), True), ((64, 64, 4, 3), True)]}
    rows = []
    for D, T in [(128, 4096), (128, 8192), (64, 8192)]:
        torch.manual_seed(0)
        q, k, v, L = make_inputs(T, D, 0.0)
        B, H = q.shape[:2]
        fl = 2.5 * flops_fwd(H, D, [T] * B)
        qd, kd, vd = (t.detach() for t in (q, k, v))
        do = torch.randn_like(qd)
        ref = sa.backward_auto(do, qd, kd, vd, L, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            oc = F.scaled_dot_product_attention(q, k, v)
        fns = {"split (op kernels)": lambda: sa.backward_auto(do, qd, kd, vd, L, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32),
               "cudnn bwd": lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True)}
        for cfg, tma in variants[D]:
            name = f"fused {'x'.join(map(str, cfg))} tma={int(tma)}"
            try:
                got = fused_backward(do, qd, kd, vd, L, cfg, tma, 1)
                torch.cuda.synchronize()
                dev = max(((a.float() - r.float()).abs().max() / r.float().abs().max()).item() for a, r in zip(got, ref))
                if dev < 2e-2:
                    fns[name] = (lambda cfg=cfg, tma=tma: fused_backward(do, qd, kd, vd, L, cfg, tma, 1))
                else:
                    print(D, T, name, "mismatch", dev, flush=True)
            except Exception as e:
                print(D, T, name, type(e).__name__, str(e)[:120], flush=True)
        times = {n: [] for n in fns}
        for _ in range(3):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=10, rep=60))
        for n in fns:
            ms = sorted(times[n])[1]
            rows.append((D, T, n, ms, fl / ms * 1e-9))
            print(f"{D:4d} {T:6d} {n:32s} {ms:8.3f} ms {fl / ms * 1e-9:6.0f} TFLOPS", flush=True)
    import pandas as pd
    pd.DataFrame(rows, columns=["D", "T", "what", "ms", "tflops"]).to_csv(f"{out}/fused_bwd.csv", index=False)


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check_cpu()
    else:
        os.makedirs(sys.argv[1], exist_ok=True)
        gpu(sys.argv[1])
