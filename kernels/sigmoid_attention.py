"""Sigmoid attention in Triton: forward, dQ and dK/dV kernels, padding-aware, with fused max|logit|.

    out_BHTD = sigmoid(q k^T * scale + b) v        over valid keys (j < L_b); rows i >= L_b are 0
    b        = -log(L_b) per sequence (bias=None) or the float given; scale = 1/sqrt(D) default
    max_BH   = max over valid (i, j) of |q_i . k_j| * scale (no bias), float32, detached

Layout: ``q/k/v_BHTD`` with any (b, h, t) strides and unit stride along D (the model passes
``permute``d views of its (B, T, 3, H, D) projection), ``lengths_B`` int32/int64 right padding.
The reference is ``kernels/reference.py::sigmoid_attention_reference``.

Maths of the backward (P = sigmoid(S), S = scale q k^T + b):
    dV = P^T dO,   dP = dO V^T,   dS = P (1 - P) dP,   dQ = scale dS K,   dK = scale dS^T Q
Sigmoid needs no row statistics (softmax needs its log-sum-exp), so both backward kernels simply
recompute S tile by tile; dQ runs over query tiles, dK/dV over key tiles: no atomics, nothing
n x n stored. The price: S and dP are computed in both, 7 matrix products per tile pair where
softmax kernels with dQ atomics run 5 (docs/BENCHMARKS.md, "The backward"). In the tanh mode,
P (1 - P) = (1 - t^2) / 4 with t = tanh(x / 2): dS is formed from t and the 1/4 rides on the
output scale, so the dQ kernel never forms P.

Padding costs nothing: padded rows of q/k/v/dO are loaded as zeros, which makes every padded pair
drop out of P V, dP and |S| without an elementwise mask; a program whose tile is wholly padding
skips its loop (writes zeros) and the loops stop at the last valid tile, so work scales with
sum(L^2), not B T^2.

Forward levers (constexprs, measured in docs/BENCHMARKS.md): ``TMA`` loads tiles through one
tensor descriptor per (b, h) over the valid rows (Hopper+, aligned strides; the hardware zero-fills
past L_b, so no masks); ``LOOKAHEAD`` issues the scores of key tile j+1 before the sigmoid of tile j,
so the special-function unit overlaps the tensor cores (one extra q k^T per query tile). Why it
matters on an H200, per score: the two products cost 4 D flops (~990 TFLOPS dense bf16), the
sigmoid one MUFU op (~3.9 T/s): at D = 64 the two take about as long, at D = 128 the MUFU half as
long; run back to back they cap the forward near 500 and 650 TFLOPS. The backward kernels take
the same two constexprs (``BWD_LEVERS`` holds the op's choice: TMA in both kernels from
T = 4096; lookahead off, it cost 17-39% there) and issue dP before the sigmoid. ``A_REGS``
passes the loop-invariant tiles (the forward's q; dQ's q and dO; dK/dV's k and v) through an
opaque register move, so the wgmmas take them from registers and read only the streamed tile
from shared memory: the forward uses it with TMA at head dim 128 (``use_a_regs``). Why it may
help there (an estimate, not measured): a 64 x 64 x 16 wgmma with both operands in shared memory
reads 4 KB in the ~32 cycles the tensor cores need for it, about all the 128 B per cycle an SM's
shared memory delivers, while the TMA refills it too. The backward does not use it (it lost).
``Q_TILES`` gives a forward program that many consecutive query tiles of one (b, h), so that it
builds its tensor descriptors once (clock probes: ~5,000 of a program's ~8,800 cycles before its
key loop, hd 128, T = 4K); the op keeps one tile per program (``FWD_Q_TILES``: four saved 3.8% of
the cycles per tile, but not measurably the op's time, session 8 in docs/BENCHMARKS.md).

Unpadded batches (every L_b == T) at head dim 128 go to the kernels of
``kernels/sigmoid_attention_dense.py`` instead (``use_dense``): the same maths with descriptors
built once on the host, so no program builds any; bit-identical results, +3% forward at T = 4K and
+5-8% at 1-2K (session 9, docs/BENCHMARKS.md). Its forward is persistent (at most one program
per SM, as few as the same rounds need: sessions 10-11, +2-6% and +2-3% more); the exact sigmoid
mode keeps the general forward, which is faster there.

Sigmoid modes (constexpr ``SIGMOID``): 0 exact ``1/(1+exp(-x))``; 1 ``0.5 tanh(x/2) + 0.5`` with
``tanh.approx.f32`` (one MUFU op, the default for 16-bit inputs). Inline PTX cannot run in the
interpreter, so the launcher picks mode 0 there at call time. Not used: packed
``tanh.approx.bf16x2`` - with b = -log n most p are ~1/n, and 0.5 + 0.5 t with t near -1 in bf16
leaves p no significant bits (max abs error 0.17 vs 0.004, docs/LOG.md); nor one sigmoid in four
on the FMA pipe (exponent-bit 2^x, a Newton reciprocal): the loops are nearly issue-bound already
and it lost 2-17% in every kernel (session 7, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.reference import sigmoid_attention_reference  # noqa: F401  (the maths)
from stabilitylab.kernels.sigmoid_attention_dense import (
    _sigmoid_bwd_dkdv_dense_kernel,
    _sigmoid_bwd_dq_dense_kernel,
    _sigmoid_fwd_dense_kernel,
    descriptors,
    set_blocks,
)
from stabilitylab.kernels.triton_support import (
    Tuned,
    capability,
    cdiv,
    check_attention_inputs,
    check_lengths_at_launch,
    interpreted,
    interpreting,
    last_dim_contiguous,
    lengths_all_full,
    persistent_grid,
    seq_bucket,
    specialization,
)

EXACT, TANH_F32 = 0, 1

# ---- kernels -------------------------------------------------------------------------------
# The sigmoid is spelled out in each kernel rather than in a @triton.jit helper: a helper is bound
# by global name, and the interpreter twin of a kernel cannot call a compiled helper.


@triton.jit
def _sigmoid_fwd_kernel(
    Q, K, V, Out, MX, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    H, T, T_BUCKET, mx_stride, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    LOOKAHEAD: tl.constexpr, A_REGS: tl.constexpr, Q_TILES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # A program takes Q_TILES consecutive query tiles of one (b, h), one after the other: its
    # descriptors are built once for all of them (docs/BENCHMARKS.md, session 8).
    pid_g = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h * sqh
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    o_base = Out + b64 * sob + h * soh
    mx_base = MX + pid_bh.to(tl.int64) * mx_stride
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    # Modes 1/2 evaluate tanh(x/2): fold the 1/2 into the per-score multiply-add.
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    # TMA: one descriptor per (b, h) over the L_b valid rows; the hardware zero-fills the rest.
    # With one tile per program they are built only when the tile has work; with several, once
    # (before the tiles' loop; a program whose tiles are all padding builds them for nothing).
    if TMA and Q_TILES > 1:
        q_desc = tl.make_tensor_descriptor(
            q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
        )
        k_desc = tl.make_tensor_descriptor(
            k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM]
        )
        v_desc = tl.make_tensor_descriptor(
            v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM]
        )
    # One tile: no loop at all, and the store outside the work branch, so it compiles as before
    # (offline, sm_90: the same registers and key loop for every production config; with the
    # store inside the branch the head-dim-64 TMA kernel took 19 more registers and 29 more
    # instructions per key tile).
    for g in (tl.static_range if Q_TILES == 1 else tl.range)(0, Q_TILES):
        tile = pid_g * Q_TILES + g
        start_m = tile * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        mx = tl.zeros((BLOCK_M,), dtype=tl.float32)
        # A query tile wholly in padding does no work: no loads, no scores.
        if start_m < L:
            if TMA and Q_TILES == 1:
                q_desc = tl.make_tensor_descriptor(
                    q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
                )
                k_desc = tl.make_tensor_descriptor(
                    k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM]
                )
                v_desc = tl.make_tensor_descriptor(
                    v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM]
                )
            if TMA:
                q = q_desc.load([start_m, 0])
            else:
                q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :],
                            mask=offs_m[:, None] < L, other=0.0)  # fmt: skip
            if A_REGS:  # q through an opaque move: the q k^T wgmma reads q from registers
                q = tl.inline_asm_elementwise(
                    "mov.b32 $0, $1;", "=r,r", [q], dtype=q.dtype, is_pure=True,
                    pack=32 // q.dtype.primitive_bitwidth,
                )  # fmt: skip
            qk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            if LOOKAHEAD:  # scores of the first key tile, ahead of the loop
                if TMA:
                    k0 = k_desc.load([0, 0])
                else:
                    k0 = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :],
                                 mask=offs_n[:, None] < L, other=0.0)  # fmt: skip
                qk = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
            for start_n in range(0, L, BLOCK_N):
                # LOOKAHEAD: load key tile j+1 and issue its scores (an asynchronous wgmma on
                # Hopper) before the sigmoid of tile j, so the MUFU works while the tensor cores
                # do. The tile past the last valid key is all zeros; its scores are discarded.
                n_k = start_n + BLOCK_N if LOOKAHEAD else start_n
                if TMA:
                    k = k_desc.load([n_k, 0])
                    v = v_desc.load([start_n, 0])
                else:
                    rows_k = n_k + offs_n
                    rows_v = start_n + offs_n
                    k = tl.load(k_base + rows_k[:, None] * skt + offs_d[None, :],
                                mask=rows_k[:, None] < L, other=0.0)  # fmt: skip
                    v = tl.load(v_base + rows_v[:, None] * svt + offs_d[None, :],
                                mask=rows_v[:, None] < L, other=0.0)  # fmt: skip
                if LOOKAHEAD:
                    qk_now = qk
                    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                else:
                    qk_now = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
                if RETURN_MAX:
                    mx = tl.maximum(mx, tl.max(tl.abs(qk_now), axis=1))
                x = qk_now * a_s + c_s
                if SIGMOID == 0:
                    p = (1.0 / (1.0 + tl.exp(-x))).to(v.dtype)
                else:
                    t = tl.inline_asm_elementwise(
                        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                        pack=1,
                    )  # fmt: skip
                    p = (0.5 * t + 0.5).to(v.dtype)
                acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
        # Padded query rows saw q = 0, so acc holds sigmoid(b) * sum(v) there: zero them.
        acc = tl.where(offs_m[:, None] < L, acc, 0.0)
        tl.store(o_base + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
        if RETURN_MAX:  # the last program's tiles may run past the buffer's columns
            tl.store(mx_base + tile, tl.max(mx, axis=0) * scale, mask=tile < mx_stride)


@triton.jit
def _sigmoid_bwd_dq_kernel(
    Q, K, V, DO, DQ, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
    H, T, T_BUCKET, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LOOKAHEAD: tl.constexpr,
    A_REGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h * sqh
    do_base = DO + b64 * sdob + h * sdoh
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    # A query tile wholly in padding does no work (its dQ is zero).
    if start_m < L:
        if TMA:
            k_desc = tl.make_tensor_descriptor(
                k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
            v_desc = tl.make_tensor_descriptor(
                v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
        row_mask = offs_m[:, None] < L
        q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :], mask=row_mask, other=0.0)
        do = tl.load(do_base + offs_m[:, None] * sdot + offs_d[None, :], mask=row_mask, other=0.0)
        if A_REGS:  # q and dO through opaque moves: the wgmmas read them from registers
            q = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [q], dtype=q.dtype, is_pure=True,
                pack=32 // q.dtype.primitive_bitwidth,
            )  # fmt: skip
            do = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [do], dtype=do.dtype, is_pure=True,
                pack=32 // do.dtype.primitive_bitwidth,
            )  # fmt: skip
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LOOKAHEAD:  # scores of the first key tile, ahead of the loop
            if TMA:
                k0 = k_desc.load([0, 0])
            else:
                k0 = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :],
                             mask=offs_n[:, None] < L, other=0.0)  # fmt: skip
            s = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
        for start_n in range(0, L, BLOCK_N):
            # LOOKAHEAD: the scores of key tile j+1 are issued before the sigmoid of tile j; tile j
            # itself is loaded again for dQ += dS K (an L2 hit, cheaper than carrying it).
            n_s = start_n + BLOCK_N if LOOKAHEAD else start_n
            if TMA:
                k_s = k_desc.load([n_s, 0])
                v = v_desc.load([start_n, 0])
                k = k_desc.load([start_n, 0]) if LOOKAHEAD else k_s
            else:
                rows_s = n_s + offs_n
                rows_n = start_n + offs_n
                k_s = tl.load(k_base + rows_s[:, None] * skt + offs_d[None, :],
                              mask=rows_s[:, None] < L, other=0.0)  # fmt: skip
                v = tl.load(v_base + rows_n[:, None] * svt + offs_d[None, :],
                            mask=rows_n[:, None] < L, other=0.0)  # fmt: skip
                if LOOKAHEAD:
                    k = tl.load(k_base + rows_n[:, None] * skt + offs_d[None, :],
                                mask=rows_n[:, None] < L, other=0.0)  # fmt: skip
                else:
                    k = k_s
            # dP needs no P: issued first, its wgmma runs while the MUFU evaluates the sigmoid.
            # Padded keys have v = 0, hence dp = 0 and ds = 0: no mask needed.
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
            if LOOKAHEAD:
                s_now = s
                s = tl.dot(q, tl.trans(k_s), input_precision=DOT_PRECISION)
            else:
                s_now = tl.dot(q, tl.trans(k_s), input_precision=DOT_PRECISION)
            x = s_now * a_s + c_s
            if SIGMOID == 0:
                p = 1.0 / (1.0 + tl.exp(-x))
                ds = (p - p * p) * dp  # p (1 - p) dp
            else:
                t = tl.inline_asm_elementwise(
                    "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
                )
                ds = (1.0 - t * t) * dp  # p (1 - p) = (1 - t^2) / 4; the 1/4 is in ds_scale
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    # Padded query rows have dO = 0, hence dQ = 0 already.
    ds_scale = scale if SIGMOID == 0 else 0.25 * scale
    tl.store(
        DQ + b64 * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
        (dq * ds_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T,
    )  # fmt: skip


@triton.jit
def _sigmoid_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
    H, T, T_BUCKET, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr, LOOKAHEAD: tl.constexpr,
    A_REGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
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
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    # A key tile wholly in padding does no work (its dK, dV are zero).
    if start_n < L:
        if TMA:
            q_desc = tl.make_tensor_descriptor(
                q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
            do_desc = tl.make_tensor_descriptor(
                do_base, shape=[L, HEAD_DIM], strides=[sdot, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
        key_mask = offs_n[:, None] < L
        k = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :], mask=key_mask, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * svt + offs_d[None, :], mask=key_mask, other=0.0)
        if A_REGS:  # k and v through opaque moves: the wgmmas read them from registers
            k = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [k], dtype=k.dtype, is_pure=True,
                pack=32 // k.dtype.primitive_bitwidth,
            )  # fmt: skip
            v = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=True,
                pack=32 // v.dtype.primitive_bitwidth,
            )  # fmt: skip
        # Transposed scores (keys x queries) so that P^T and dS^T feed the dots without a transpose.
        s_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        if LOOKAHEAD:  # scores of the first query tile, ahead of the loop
            if TMA:
                q0 = q_desc.load([0, 0])
            else:
                q0 = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :],
                             mask=offs_m[:, None] < L, other=0.0)  # fmt: skip
            s_t = tl.dot(k, tl.trans(q0), input_precision=DOT_PRECISION)
        for start_m in range(0, L, BLOCK_M):
            # LOOKAHEAD: the scores of query tile i+1 are issued before the sigmoid of tile i; tile
            # i itself is loaded again for dK += dS^T Q.
            m_s = start_m + BLOCK_M if LOOKAHEAD else start_m
            if TMA:
                q_s = q_desc.load([m_s, 0])
                do = do_desc.load([start_m, 0])
                q = q_desc.load([start_m, 0]) if LOOKAHEAD else q_s
            else:
                rows_s = m_s + offs_m
                rows_m = start_m + offs_m
                q_s = tl.load(q_base + rows_s[:, None] * sqt + offs_d[None, :],
                              mask=rows_s[:, None] < L, other=0.0)  # fmt: skip
                do = tl.load(do_base + rows_m[:, None] * sdot + offs_d[None, :],
                             mask=rows_m[:, None] < L, other=0.0)  # fmt: skip
                if LOOKAHEAD:
                    q = tl.load(q_base + rows_m[:, None] * sqt + offs_d[None, :],
                                mask=rows_m[:, None] < L, other=0.0)  # fmt: skip
                else:
                    q = q_s
            # dP^T first (it needs no P), so its wgmma can run while the MUFU evaluates the sigmoid.
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            if LOOKAHEAD:
                s_now = s_t
                s_t = tl.dot(k, tl.trans(q_s), input_precision=DOT_PRECISION)
            else:
                s_now = tl.dot(k, tl.trans(q_s), input_precision=DOT_PRECISION)
            x_t = s_now * a_s + c_s
            if SIGMOID == 0:
                p_t = 1.0 / (1.0 + tl.exp(-x_t))
                ds_t = (p_t - p_t * p_t) * dp_t
            else:
                t = tl.inline_asm_elementwise(
                    "tanh.approx.f32 $0, $1;", "=f,f", [x_t], dtype=tl.float32, is_pure=True, pack=1
                )
                p_t = 0.5 * t + 0.5
                ds_t = (1.0 - t * t) * dp_t  # 4 p (1 - p) dP^T; the 1/4 is in ds_scale
            # Padded queries have dO = 0: their columns add nothing to dV or dS^T.
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    # Padded key rows saw k = 0 (and v = 0): zero their dK and dV on the way out.
    ds_scale = scale if SIGMOID == 0 else 0.25 * scale
    valid = offs_n[:, None] < L
    in_range = offs_n[:, None] < T
    tl.store(
        DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
        tl.where(valid, dk * ds_scale, 0.0).to(DK.dtype.element_ty), mask=in_range,
    )  # fmt: skip
    tl.store(
        DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
        tl.where(valid, dv, 0.0).to(DV.dtype.element_ty), mask=in_range,
    )  # fmt: skip


# ---- launch configs ----------------------------------------------------------------------------
# Production configs per architecture; the GPU tests run these same lists. The interpreter runs one
# small config (it is slow and tl.dot needs tiles of at least 16).

INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


@functools.cache  # called on every forward (the max-logit buffer size): build the list once
def _configs(
    kind: str, cap: tuple[int, int], fp32: bool = False, dense: bool = False
) -> tuple[triton.Config, ...]:  # fmt: skip
    """``kind``: fwd (BLOCK_M queries x BLOCK_N keys per step), dq (same), dkdv (BLOCK_N keys fixed).
    ``dense``: the same tiles for the kernels of unpadded batches, whose host-built descriptors
    take their blocks from the config (``set_blocks``, a pre-hook).

    float32 (a testing dtype) gets small tiles of its own: the 16-bit tiles at 4 bytes a value
    overflow shared memory at head dim 128, and compiling them took minutes on the H200."""
    if fp32:
        blocks = {"fwd": [(64, 32, 4, 2)], "dq": [(64, 32, 4, 2)], "dkdv": [(32, 64, 4, 2)]}[kind]
    elif cap[0] >= 9:
        # (BLOCK_M, BLOCK_N, num_warps, num_stages); three each keeps first-call autotuning short.
        blocks = {
            "fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3)],
            # Backward lists from kernels/sweep_configs.py (docs/BENCHMARKS.md, sweeps 1-2): dK/dV
            # wants 64 x 64 tiles on 4 warps at hd64 and 64 x 128 on 8 warps at hd128.
            "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
            "dkdv": [(64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
        }[kind]
    else:
        blocks = {
            "fwd": [(128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
            "dq": [(64, 64, 4, 2), (64, 32, 4, 2)],
            "dkdv": [(32, 64, 4, 2), (64, 64, 4, 2)],
        }[kind]
    hook = set_blocks if dense else None
    return tuple(
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=hook)
        for m, n, w, s in blocks
    )


_TUNED: dict[tuple, Tuned] = {}
# Each kernel's lever constexprs: with the T bucket and head dim, its autotune key.
_LEVERS = {
    _sigmoid_fwd_kernel: ("TMA", "LOOKAHEAD", "SIGMOID", "A_REGS", "Q_TILES"),
    _sigmoid_bwd_dq_kernel: ("TMA", "LOOKAHEAD", "SIGMOID", "A_REGS"),
    _sigmoid_bwd_dkdv_kernel: ("TMA", "LOOKAHEAD", "SIGMOID", "A_REGS"),
    _sigmoid_fwd_dense_kernel: ("SIGMOID", "A_REGS"),
    _sigmoid_bwd_dq_dense_kernel: ("SIGMOID",),
    _sigmoid_bwd_dkdv_dense_kernel: ("SIGMOID",),
}
_DENSE = (_sigmoid_fwd_dense_kernel, _sigmoid_bwd_dq_dense_kernel, _sigmoid_bwd_dkdv_dense_kernel)


def _launch(kernel, kind: str, q: torch.Tensor, grid, args: tuple, kwargs: dict) -> None:
    """Launch ``kernel``: interpreted with one config, or autotuned per architecture, Triton
    specialisation of ``args`` (``specialization``) and key (T bucket, head dim, levers, dtype),
    then launched straight with the config chosen."""
    dense = kernel in _DENSE
    if interpreting():
        if dense:
            set_blocks({**kwargs, **INTERPRETER_BLOCKS})
        interpreted(kernel)[grid](*args, **kwargs, **INTERPRETER_BLOCKS)
        return
    cap, fp32 = capability(q.device), q.dtype == torch.float32
    levers = _LEVERS[kernel]
    which = (kernel, cap, fp32, specialization(*args))
    tuned = _TUNED.get(which)
    if tuned is None:
        tuned = _TUNED[which] = Tuned(
            kernel, _configs(kind, cap, fp32, dense), ["T_BUCKET", "HEAD_DIM", *levers]
        )
    key = (seq_bucket(q.shape[2]), kwargs["HEAD_DIM"], *[kwargs[n] for n in levers], q.dtype)
    tuned.launch(grid, key, *args, **kwargs)


def _common_args(D: int, dtype: torch.dtype, log_bias: bool, sigmoid: int, a_regs: bool) -> dict:
    """Constexprs every kernel takes. Inline PTX cannot run in the interpreter: there the exact
    sigmoid and no register moves, whatever was asked."""
    return {
        "HEAD_DIM": D,
        "LOG_BIAS": log_bias,
        "SIGMOID": EXACT if interpreting() else sigmoid,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "A_REGS": a_regs and not interpreting(),
    }


def _kernel_args(strided: tuple, extra: tuple, lengths, H: int, T: int, *tail) -> tuple:
    """The kernels' positional arguments, in their signatures' order: the (B, H, T, D) tensors,
    other pointers (the forward's max buffer), lengths, the (b, h, t) strides of each (B, H, T, D)
    tensor, H, T, the T bucket of the autotune key, then ``tail``."""
    strides = [st for t in strided for st in t.stride()[:3]]
    return (*strided, *extra, lengths, *strides, H, T, seq_bucket(T), *tail)


def _empty_bthd_as_bhtd(like: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) view of (B, T, H, D) memory: the model's ``transpose(1, 2).reshape`` is free."""
    B, H, T, D = like.shape
    return torch.empty(B, T, H, D, dtype=like.dtype, device=like.device).permute(0, 2, 1, 3)


# ---- torch.library ops (compile-friendly) + autograd --------------------------------------------
# ``custom_op``, not ``triton_op``: torch.compile sees each op as one opaque node (no graph break
# under fullgraph=True) and runs the body as in eager, with the real tensors' strides. Traced
# through as a ``triton_op``, inductor returned wrong values on the H200 (NaN, ~100x off) for
# reasons not pinned down (docs/LOG.md); an opaque op gives that up for certainty.


def _device_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch for the tensor descriptors the kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _unused_f32(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA descriptors for these (B, H, T, D) tensors: Hopper or newer (or the interpreter), and
    every (b, h) base and row stride 16-byte aligned (the model's packed qkv views are)."""
    t0 = tensors[0]
    if not interpreting() and capability(t0.device)[0] < 9:
        return False
    size = t0.element_size()
    # Plain loops: this runs on every call, and the host time before a launch is GPU idle time
    # whenever the GPU is not ahead (docs/BENCHMARKS.md, "Host overhead").
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        sb, sh, st = t.stride()[:3]
        if (sb * size) % 16 or (sh * size) % 16 or (st * size) % 16:
            return False
    return True


TMA_MIN_T = 4096
# The backward's levers (the same constexprs as the forward's), from the sweeps in
# docs/BENCHMARKS.md: TMA helps the dK/dV kernel (its loop streams Q and dO: -2% to -6% time at
# T >= 4K unpadded, -10% at 25% padding), and the dQ kernel at head dim 128 (session 7: the op's
# backward +1.3% to +2.9%; at head dim 64 within +-0.7%, though offline its loop shrinks from 433
# to 256 instructions per warp and tile); lookahead costs both 17-39%. With it, the scores stay in
# flight across the loop's back edge and ptxas serializes every wgmma of the loop (its note C7514;
# session 13, offline); one more score tile is live, and the loop's tiles are loaded twice.
BWD_LEVERS = {"tma_dq": True, "tma_dkdv": True, "lookahead": False, "a_regs": False}
# A_REGS (the loop-invariant A operand of the wgmmas through an opaque register move, so they read
# it from registers and only the streamed tile from shared memory): forward at head dim 128 only.
FWD_A_REGS_HEAD_DIMS = (128,)
# Query tiles per forward program in the op: one. Four (the lever ``Q_TILES``: a program builds
# its three tensor descriptors once for all its tiles) cut the cycles per tile by 3.8% at head dim
# 128, T = 4K, in clock probes, but the op's forward time did not follow (+2.3% / +0.9% / +0.3%
# at 4K / 8K / 16K in one call, medians of per-round gains; -1.1% / -2.4% / +1.1% in another;
# the boards run at their power cap, docs/BENCHMARKS.md, session 8).
FWD_Q_TILES = 1


def use_tma(*tensors: torch.Tensor) -> bool:
    """The op's choice for these (B, H, T, D) tensors: TMA loads from T = 4096 up, where they beat pointer loads; below, building
    a descriptor per program costs more than it saves, most of all under heavy padding (H200,
    2026-11-29: T = 2048 with 50% padding, head dim 128: 212 vs 377 TFLOPS; docs/BENCHMARKS.md)."""
    return tensors[0].shape[2] >= TMA_MIN_T and tma_ok(*tensors)


def launch_forward(
    q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, *, tma: bool, lookahead: bool,
    a_regs: bool = False, q_tiles: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Launch the forward kernel with the levers given (the op picks them; the benchmark forces
    them to measure each): ``tma`` tensor-descriptor loads, ``lookahead`` next-tile scores,
    ``a_regs`` q held in registers for the q k^T wgmma, ``q_tiles`` query tiles per program."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    if tma and not tma_ok(q, k, v):
        raise ValueError("tma: needs sm90+ and 16-byte aligned (b, h, t) strides and bases")
    if not (isinstance(q_tiles, int) and 1 <= q_tiles <= 16):
        raise ValueError(f"q_tiles: want an int in [1, 16], got {q_tiles!r}")
    return _forward(
        q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, tma, lookahead, a_regs,
        q_tiles,
    )  # fmt: skip


def _forward(
    q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, tma, lookahead, a_regs=False,
    q_tiles=1,
):  # fmt: skip
    """``launch_forward`` on inputs already made unit-stride along D, with ``tma`` already
    checked: the op's path, which runs these checks once."""
    B, H, T, D = q.shape
    if tma and not interpreting():
        triton.set_allocator(_device_allocator)
    out = _empty_bthd_as_bhtd(q)
    mx, n_mx = _max_buffer(q, return_max)
    grid = lambda meta: (cdiv(cdiv(T, meta["BLOCK_M"]), q_tiles), B * H)
    args = _kernel_args((q, k, v, out), (mx,), lengths, H, T, n_mx, scale, bias)
    kwargs = dict(RETURN_MAX=return_max, TMA=tma, LOOKAHEAD=lookahead, Q_TILES=q_tiles)
    _launch(
        _sigmoid_fwd_kernel,
        "fwd",
        q,
        grid,
        args,
        {**kwargs, **_common_args(D, q.dtype, log_bias, sigmoid, a_regs)},
    )
    max_bh = mx.amax(dim=1).view(B, H) if return_max else mx.new_empty(0)
    return out, max_bh


def _max_buffer(q: torch.Tensor, return_max: bool) -> tuple[torch.Tensor, int]:
    """The forward's per-(b*h, query tile) max|logit| buffer and its columns: sized for the smallest
    BLOCK_M of any config, so programs that do not exist leave a neutral 0. Without the max the
    kernel never touches it: a cached scalar (no fill kernel per call)."""
    B, H, T, _ = q.shape
    if not return_max:
        return _unused_f32(q.device), 1
    if interpreting():
        n_mx = cdiv(T, INTERPRETER_BLOCKS["BLOCK_M"])
    else:
        fwd_configs = _configs("fwd", capability(q.device), q.dtype == torch.float32)
        n_mx = cdiv(T, min(c.kwargs["BLOCK_M"] for c in fwd_configs))
    return torch.zeros(B * H, n_mx, dtype=torch.float32, device=q.device), n_mx


# The dense kernels (unpadded batches, descriptors built on the host) at head dim 128 only. H200,
# session 9 (docs/BENCHMARKS.md), against the general kernels in one process (call 3): head dim
# 128 forward +5% / +8% / +3% / +1% / 0% at T = 1K / 2K / 4K / 8K / 16K, backward +5% / +5% / +3% /
# +1% / +3%, bit-identical results. Head dim 64: forward -1% at 8K and 16K in both calls that timed
# it, the backward mixed (-3% to +8%), and the model step (hd 64, 8K) up to 0.65 ms slower: there
# two programs share an SM and overlap each other's descriptor builds (session 8's clock probes).
DENSE_HEAD_DIMS = (128,)


def use_dense(lengths: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """The op's choice of the kernels for unpadded batches (``sigmoid_attention_dense.py``): no
    sequence padded (``lengths_all_full``; never under CUDA graph capture), head dim in
    ``DENSE_HEAD_DIMS``, 16-bit (float32 is a testing dtype), and rank-4 descriptors possible:
    sm90+ or the interpreter, 16-byte aligned, no zero (broadcast) stride."""
    q = tensors[0]
    return (
        q.shape[-1] in DENSE_HEAD_DIMS
        and q.dtype != torch.float32
        and tma_ok(*tensors)
        and all(st > 0 for t in tensors for st in t.stride())
        and lengths_all_full(lengths, q.shape[2])
    )


def _forward_dense(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, a_regs):
    """The forward of an unpadded batch: descriptors built here, once per call."""
    B, H, T, D = q.shape
    out = _empty_bthd_as_bhtd(q)
    mx, n_mx = _max_buffer(q, return_max)
    # Persistent: at most one program per SM, each looping over query tiles (session 10: +2% to
    # +6% over one program per tile at T = 16K / 4K, hd 128; docs/BENCHMARKS.md), and no more
    # programs than the same number of rounds needs (``persistent_grid``, session 11).
    grid = lambda meta: (persistent_grid(cdiv(T, meta["BLOCK_M"]) * B * H, q.device),)
    args = (out, mx, lengths, *out.stride()[:3], H, T, seq_bucket(T), n_mx, scale, bias, B * H)
    kwargs = {
        "RETURN_MAX": return_max,
        **descriptors(Q=q, K=k, V=v),
        **_common_args(D, q.dtype, log_bias, sigmoid, a_regs),
    }
    _launch(_sigmoid_fwd_dense_kernel, "fwd", q, grid, args, kwargs)
    max_bh = mx.amax(dim=1).view(B, H) if return_max else mx.new_empty(0)
    return out, max_bh


def _backward_dense(do, q, k, v, lengths, scale, bias, log_bias, sigmoid):
    """The dQ and dK/dV kernels of an unpadded batch: ``(dq, dk, dv)``."""
    B, H, T, D = q.shape
    common = _common_args(D, q.dtype, log_bias, sigmoid, False)
    del common["A_REGS"]  # the dense backward kernels have no such lever
    desc = descriptors(Q=q, K=k, V=v, DO=do)
    dq = _empty_bthd_as_bhtd(q)
    args = (dq, lengths, *dq.stride()[:3], H, T, seq_bucket(T), scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    _launch(_sigmoid_bwd_dq_dense_kernel, "dq", q, grid, args, {**common, **desc})
    # The same descriptors: each launch encodes them with the block its config's pre-hook sets.
    dk, dv = _empty_bthd_as_bhtd(k), _empty_bthd_as_bhtd(v)
    args = (dk, dv, lengths, *dk.stride()[:3], *dv.stride()[:3], H, T, seq_bucket(T), scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_N"]), B * H)
    _launch(_sigmoid_bwd_dkdv_dense_kernel, "dkdv", q, grid, args, {**common, **desc})
    return dq, dk, dv


def use_a_regs(q: torch.Tensor, tma: bool) -> bool:
    """The forward's ``A_REGS`` choice: q read by the q k^T wgmma from registers, not shared
    memory, with TMA loads at head dim 128 in 16-bit. H200, session 7 (docs/BENCHMARKS.md): the
    op +1.4% / +2.3% / +2.2% forward TFLOPS at T = 4K / 8K / 16K, +1% to +3% with 25-50% padding;
    with pointer loads (T < 4K) -4%; at head dim 64 (-6% to -13%) and in the backward kernels
    (-2% to -17%) it lost."""
    return tma and q.shape[-1] in FWD_A_REGS_HEAD_DIMS and q.dtype != torch.float32


def forward_auto(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max):
    """The forward with the op's choice: an unpadded batch in the fast sigmoid mode to the
    persistent dense kernel (``use_dense``; q in registers at head dim 128); else TMA from
    T = 4096 where possible, lookahead, q in registers with TMA at head dim 128, ``FWD_Q_TILES``
    query tiles per program."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    # The exact sigmoid keeps the general forward: persistent, its dense twin ran 7% slower
    # (session 10, hd 128, T = 4K-16K; docs/BENCHMARKS.md).
    if sigmoid != EXACT and use_dense(lengths, q, k, v):
        return _forward_dense(
            q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, use_a_regs(q, True)
        )
    tma = use_tma(q, k, v)
    return _forward(
        q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, tma, True,
        use_a_regs(q, tma), FWD_Q_TILES,
    )  # fmt: skip


@torch.library.custom_op("stabilitylab::sigmoid_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    bias: float,
    log_bias: bool,
    sigmoid: int,
    return_max: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The op runs under torch.compile, whose tracing skipped the lengths' range check.
    check_lengths_at_launch(lengths, q.shape[2])
    return forward_auto(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max)


def launch_backward(
    do,
    q,
    k,
    v,
    lengths,
    scale,
    bias,
    log_bias,
    sigmoid,
    *,
    tma_dq: bool,
    tma_dkdv: bool,
    lookahead: bool,
    a_regs: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the dQ and the dK/dV kernels with the levers given: ``(dq, dk, dv)``; ``a_regs``
    holds each kernel's loop-invariant tiles (q and dO; k and v) in registers for its wgmmas."""
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    if (tma_dq or tma_dkdv) and not tma_ok(q, k, v, do):
        raise ValueError("tma: needs sm90+ and 16-byte aligned (b, h, t) strides and bases")
    return _backward_launch(
        do, q, k, v, lengths, scale, bias, log_bias, sigmoid, tma_dq, tma_dkdv, lookahead, a_regs
    )


def _backward_launch(
    do, q, k, v, lengths, scale, bias, log_bias, sigmoid, tma_dq, tma_dkdv, lookahead, a_regs=False
):  # fmt: skip
    """``launch_backward`` on checked inputs (the op's path). The dQ kernel is launched before
    dK and dV are even allocated: host time ahead of the first launch is GPU idle time."""
    B, H, T, D = q.shape
    if (tma_dq or tma_dkdv) and not interpreting():
        triton.set_allocator(_device_allocator)
    dq = _empty_bthd_as_bhtd(q)
    common = _common_args(D, q.dtype, log_bias, sigmoid, a_regs)
    args = _kernel_args((q, k, v, do, dq), (), lengths, H, T, scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    _launch(
        _sigmoid_bwd_dq_kernel,
        "dq",
        q,
        grid,
        args,
        {**common, "TMA": tma_dq, "LOOKAHEAD": lookahead},
    )
    dk, dv = _empty_bthd_as_bhtd(k), _empty_bthd_as_bhtd(v)
    args = _kernel_args((q, k, v, do, dk, dv), (), lengths, H, T, scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_N"]), B * H)
    _launch(
        _sigmoid_bwd_dkdv_kernel,
        "dkdv",
        q,
        grid,
        args,
        {**common, "TMA": tma_dkdv, "LOOKAHEAD": lookahead},
    )
    return dq, dk, dv


def backward_auto(do, q, k, v, lengths, scale, bias, log_bias, sigmoid):
    """The backward with the op's choice: an unpadded batch to the dense kernels (``use_dense``),
    else ``BWD_LEVERS`` (TMA from T = TMA_MIN_T only)."""
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    if use_dense(lengths, q, k, v, do):
        return _backward_dense(do, q, k, v, lengths, scale, bias, log_bias, sigmoid)
    tma = use_tma(q, k, v, do)
    return _backward_launch(
        do, q, k, v, lengths, scale, bias, log_bias, sigmoid,
        tma and BWD_LEVERS["tma_dq"], tma and BWD_LEVERS["tma_dkdv"], BWD_LEVERS["lookahead"],
        BWD_LEVERS["a_regs"],
    )  # fmt: skip


@torch.library.custom_op("stabilitylab::sigmoid_attention_bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    bias: float,
    log_bias: bool,
    sigmoid: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_lengths_at_launch(lengths, q.shape[2])  # as in the forward op
    return backward_auto(do, q, k, v, lengths, scale, bias, log_bias, sigmoid)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max):
    B, H = q.shape[:2]
    max_bh = q.new_empty((B, H) if return_max else (0,), dtype=torch.float32)
    return _empty_bthd_as_bhtd(q), max_bh


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, lengths, scale, bias, log_bias, sigmoid):
    return tuple(_empty_bthd_as_bhtd(t) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, lengths, scale, bias, log_bias, sigmoid, _ = inputs
    ctx.save_for_backward(q, k, v, lengths)
    ctx.args = (scale, bias, log_bias, sigmoid)


def _backward(ctx, d_out, _d_max):
    q, k, v, lengths = ctx.saved_tensors
    dq, dk, dv = _bwd_op(d_out, q, k, v, lengths, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerSigmoidAttention(torch.autograd.Function):
    """The same launches as the ops, for eager mode: a custom op's Python dispatch and autograd
    wrapper cost ~250 us of host time per call on the H200 host (docs/BENCHMARKS.md), which shows
    whenever a kernel is that short (T <= 1K, or heavy padding)."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max):
        out, max_bh = forward_auto(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max)
        ctx.save_for_backward(q, k, v, lengths)
        ctx.args = (scale, bias, log_bias, sigmoid)
        ctx.mark_non_differentiable(max_bh)
        return out, max_bh

    @staticmethod
    def backward(ctx, d_out, _d_max):
        q, k, v, lengths = ctx.saved_tensors
        dq, dk, dv = backward_auto(d_out, q, k, v, lengths, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ---- public function ---------------------------------------------------------------------------


def default_fast_mode(dtype: torch.dtype) -> int:
    """Sigmoid mode for ``exact=False``: the hardware tanh for 16-bit inputs, exact for float32
    (which asks for float32 accuracy). Near x = -log n the tanh's p carries up to ~1e-2 relative
    error and a small negative bias (kernels/check_tanh.py; docs/BENCHMARKS.md): at T = 8K the
    kernel's row sums err 1.2e-3 (exact mode 9.9e-4, the fp16 output rounding); far longer contexts
    should take ``exact=True``."""
    return EXACT if dtype == torch.float32 else TANH_F32


def sigmoid_attention(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    scale: float | None = None,
    bias: float | None = None,
    exact: bool = False,
    return_max_logit: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out_BHTD, max_logit_BH | None)``; see the module docstring for formula and layout.

    ``exact=True`` evaluates ``1/(1+exp(-x))``; the default uses the hardware tanh on CUDA for
    bf16/fp16 inputs. The output is a (B, H, T, D) view of (B, T, H, D) memory.
    """
    named = {"q_BHTD": q_BHTD, "k_BHTD": k_BHTD, "v_BHTD": v_BHTD}
    check_attention_inputs(named, lengths_B, scale, bias)
    scale = 1.0 / math.sqrt(q_BHTD.shape[-1]) if scale is None else float(scale)
    mode = EXACT if exact else default_fast_mode(q_BHTD.dtype)
    bias_f = 0.0 if bias is None else float(bias)
    # Under torch.compile the opaque custom op (no graph break); in eager the cheaper Function.
    fn = _fwd_op if torch.compiler.is_compiling() else _EagerSigmoidAttention.apply
    out_BHTD, max_BH = fn(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, scale, bias_f, bias is None, mode, return_max_logit
    )
    return out_BHTD, (max_BH.detach() if return_max_logit else None)
