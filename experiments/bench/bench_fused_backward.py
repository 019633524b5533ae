"""The fused sigmoid backward (dK, dV and dQ in one kernel over key tiles, dQ reduced in float32
through a TMA reduce or pointer atomics) against the split dQ + dK/dV kernels, at the model's
shape (4 x 12 heads, T = 8192, head dim 64, bf16, tanh mode): do_bench medians, TFLOPS over
2.5 x the forward's 4 B H D T^2 flops, the largest error of each gradient relative to the split's
largest value. The kernel here is a stand-alone copy with the reduce and the query order as
switches; ``op fused`` is the op's own (kernels/sigmoid_attention_fused_bwd.py), autotuned.

    python experiments/bench/bench_fused_backward.py          # GPU
    TRITON_INTERPRET=1 python experiments/bench/bench_fused_backward.py [pad]   # CPU check
"""

import importlib
import os
import sys

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.sigmoid_attention import (
    EXACT,
    TANH_F32,
    ds_scale,
    key_affine,
    load_rows,
    p_and_ds,
    score_affine,
)

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")  # the module, not the op
INTERP = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fused_kernel(
    Q,
    K,
    V,
    DO,
    DK,
    DV,
    DQ32,
    LENS,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdob,
    sdoh,
    sdot,
    sdkb,
    sdkh,
    sdkt,
    sdvb,
    sdvh,
    sdvt,
    sdqb,
    sdqh,
    sdqt,
    H,
    T,
    scale,
    bias,
    HEAD_DIM: tl.constexpr,
    LOG_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    REDUCE_TMA: tl.constexpr,
    STAGGER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
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
    dq_base = DQ32 + b64 * sdqb + h * sdqh
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    if start_n < L:
        q_src = tl.make_tensor_descriptor(
            q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
        )
        do_src = tl.make_tensor_descriptor(
            do_base, shape=[L, HEAD_DIM], strides=[sdot, 1], block_shape=[BLOCK_M, HEAD_DIM]
        )
        if REDUCE_TMA:
            dq_dst = tl.make_tensor_descriptor(
                dq_base, shape=[L, HEAD_DIM], strides=[sdqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
        k = load_rows(k_base, offs_n, skt, L, offs_d)
        v = load_rows(v_base, offs_n, svt, L, offs_d)
        c = key_affine(c_s, k_base, offs_n[:, None], L, False, SIGMOID)
        n_m = tl.cdiv(L, BLOCK_M)
        for j in range(0, n_m):
            if STAGGER:
                start_m = ((j + pid_n) % n_m) * BLOCK_M
            else:
                start_m = j * BLOCK_M
            queries = start_m + offs_m
            q = q_src.load([start_m, 0])
            do = do_src.load([start_m, 0])
            p_t, ds_t = p_and_ds(
                k,
                q,
                v,
                do,
                a_s,
                c,
                queries[None, :],
                offs_n[:, None],
                False,
                SIGMOID,
                DOT_PRECISION,
            )
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            ds16 = ds_t.to(q.dtype)
            dk = tl.dot(ds16, q, dk, input_precision=DOT_PRECISION)
            dq_part = tl.dot(tl.trans(ds16), k, input_precision=DOT_PRECISION)
            if REDUCE_TMA:
                dq_dst.atomic_add([start_m, 0], dq_part)
            else:
                tl.atomic_add(
                    dq_base + queries[:, None] * sdqt + offs_d[None, :],
                    dq_part,
                    mask=queries[:, None] < L,
                    sem="relaxed",
                )
    dk_scale = ds_scale(scale, SIGMOID)
    valid = offs_n[:, None] < L
    in_range = offs_n[:, None] < T
    tl.store(
        DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
        tl.where(valid, dk * dk_scale, 0.0).to(DK.dtype.element_ty),
        mask=in_range,
    )
    tl.store(
        DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
        tl.where(valid, dv, 0.0).to(DV.dtype.element_ty),
        mask=in_range,
    )


def fused_backward(do, q, k, v, lengths, scale, sigmoid, cfg, reduce_tma=True, stagger=True):
    B, H, T, D = q.shape
    if not INTERP:
        triton.set_allocator(sa._device_allocator)
    dq32 = torch.zeros(B, T, H, D, dtype=torch.float32, device=q.device).permute(0, 2, 1, 3)
    dk, dv = sa._empty_bthd_as_bhtd(k), sa._empty_bthd_as_bhtd(v)
    bm, bn, w, s = cfg
    strides = [st for t in (q, k, v, do, dk, dv, dq32) for st in t.stride()[:3]]
    _fused_kernel[(triton.cdiv(T, bn), B * H)](
        q,
        k,
        v,
        do,
        dk,
        dv,
        dq32,
        lengths,
        *strides,
        H,
        T,
        scale,
        0.0,
        HEAD_DIM=D,
        LOG_BIAS=True,
        SIGMOID=EXACT if INTERP else sigmoid,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        REDUCE_TMA=reduce_tma and not INTERP,
        STAGGER=stagger,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **({} if INTERP else {"num_warps": w, "num_stages": s}),
    )
    f = 1.0 / 4 * scale if (sigmoid == TANH_F32 and not INTERP) else scale
    dq = (dq32 * f).to(q.dtype)
    return dq, dk, dv


def split_backward(do, q, k, v, lengths, scale, sigmoid, fused=False):
    return sa._backward(do, q, k, v, lengths, scale, 0.0, True, sigmoid, True, fused=fused)[:3]


def main():
    dev = "cpu" if INTERP else "cuda"
    if INTERP:
        B, H, T, D, dt = 2, 2, 64, 16, torch.float32
        configs = [(16, 16, 4, 2)]
    else:
        B, H, T, D, dt = 4, 12, 8192, 64, torch.bfloat16
        configs = [
            (64, 128, 8, 2),
            (64, 128, 8, 3),
            (64, 128, 4, 2),
            (128, 128, 8, 2),
            (64, 64, 4, 3),
            (32, 128, 4, 3),
            (128, 64, 8, 2),
        ]
    torch.manual_seed(0)
    # (B, T, 3, H, D) packed, as the model's views
    qkv = torch.randn(B, T, 3, H, D, device=dev, dtype=dt)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    do = torch.randn(B, T, H, D, device=dev, dtype=dt).transpose(1, 2)
    lengths = torch.full((B,), T, dtype=torch.int32, device=dev)
    if len(sys.argv) > 1 and sys.argv[1] == "pad":
        lengths[0] = T - T // 3
    scale = D**-0.5
    mode = EXACT if INTERP else TANH_F32
    ref = split_backward(do, q, k, v, lengths, scale, mode)
    flops = 2.5 * 4 * B * H * D * T * T

    def tf(ms):
        return flops / ms / 1e9

    if not INTERP:
        ms = triton.testing.do_bench(
            lambda: split_backward(do, q, k, v, lengths, scale, mode), warmup=50, rep=300
        )
        print(f"split  {ms:.3f} ms  {tf(ms):.0f} TFLOPS(5-product count)", flush=True)
        got = split_backward(do, q, k, v, lengths, scale, mode, True)
        err = [
            ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
            for g, r in zip(got, ref, strict=False)
        ]
        ms = triton.testing.do_bench(
            lambda: split_backward(do, q, k, v, lengths, scale, mode, True), warmup=50, rep=300
        )
        print(
            f"op fused (autotuned over {sa.FUSED_CONFIGS})  {ms:.3f} ms  {tf(ms):.0f}  rel.err "
            + " ".join(f"{e:.1e}" for e in err),
            flush=True,
        )
    for cfg in configs:
        for reduce_tma, stagger in (
            [(True, True), (True, False), (False, True)]
            if not INTERP
            else [(False, True), (False, False)]
        ):
            try:
                got = fused_backward(do, q, k, v, lengths, scale, mode, cfg, reduce_tma, stagger)
                err = [
                    ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
                    for g, r in zip(got, ref, strict=False)
                ]
                ms = float("nan")
                if not INTERP:
                    ms = triton.testing.do_bench(
                        lambda c=cfg, r=reduce_tma, st=stagger: fused_backward(
                            do, q, k, v, lengths, scale, mode, c, r, st
                        ),
                        warmup=50,
                        rep=300,
                    )
                print(
                    f"fused {cfg} tma={reduce_tma} stagger={stagger}  {ms:.3f} ms  {tf(ms):.0f}  rel.err dq/dk/dv "
                    + " ".join(f"{e:.1e}" for e in err),
                    flush=True,
                )
            except Exception as e:
                print(
                    f"fused {cfg} tma={reduce_tma} stagger={stagger} FAILED {type(e).__name__}: {str(e)[:300]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
