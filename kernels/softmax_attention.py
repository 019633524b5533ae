"""Softmax attention in Triton on the sigmoid kernel's skeleton: forward (online softmax, fused
max|logit|), Delta, dQ, dK/dV; padding, causal, key bias; no atomics, so bit-reproducible.

    out_i = sum_{j visible} softmax_j(S_ij) v_j, S_ij = scale q_i . k_j + kb_j; padded query rows 0
    lse_i = log sum_{j visible} exp(S_ij), float32, saved for the backward (0 at padded rows)
    visible: j < L_b, and j <= i if causal; kb an optional per-key bias (B, H, T); max_BH as the
    sigmoid kernel's (max over visible pairs of scale |q_i . k_j|, no bias, NaN if a score is NaN)
    backward, P = exp(S - lse), Delta_i = dO_i . O_i: dV = P^T dO, dP = dO V^T, dS = P (dP - Delta),
    dQ = scale dS K, dK = scale dS^T Q, d kb_j = sum_i dS_ij (per head)

The sigmoid kernel's (kernels/sigmoid_attention.py) tiles, tile helpers, causal splits, padding
rules, launch configs and launcher, imported from there: a paired run's two arms share one
numerical skeleton and differ in the nonlinearity. The forward keeps a running row max m and sum l
(base 2: exp2 of scores pre-multiplied by log2 e) and divides at the end. The backward recomputes
P per tile from lse: dQ over query tiles, dK/dV and d kb over key tiles, each reduced in a fixed
order, no atomics. Unlike the sigmoid, a key past L_b would add exp(0 - m) to a row's sum, so the
forward and the dQ pass mask the last key tile when not causal (the causal diagonal mask covers it
otherwise) and the dK/dV pass gives padded keys a bias of -inf; padded query rows read lse = +inf
in the backward. Either way P = 0 exactly: padding makes no inf or NaN, whatever the scores.

Maths: kernels/reference.py (softmax_attention_reference). Limits: head dim 64 or 128; bf16, fp16,
fp32; on CPU only in Triton's interpreter. Not carried over from the sigmoid op (not measured for
softmax): the kernels for unpadded batches (sigmoid_attention_dense.py), q read from registers,
the forward's scores of the next key tile issued ahead of this tile's nonlinearity.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.reference import softmax_attention_reference  # noqa: F401  (the maths)
from stabilitylab.kernels.sigmoid_attention import (
    _device_allocator,
    _empty_bthd_as_bhtd,
    _kernel_args,
    _launch,
    _mask_and_bias_args,
    _max_buffer,
    causal_key_split,
    causal_query_split,
    key_affine,
    load_rows,
    load_tile,
    tile_order,
    use_tma,
)
from stabilitylab.kernels.triton_support import (
    bits_as_max,
    cdiv,
    check_attention_inputs,
    check_key_bias,
    check_lengths_at_launch,
    compiled,
    interpreted,
    interpreting,
    last_dim_contiguous,
    max_abs_bits,
)

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)

# ---- tile helpers (beside the sigmoid kernel's) ------------------------------------------------


@triton.jit
def hide(x, q_idx, k_idx, L, fill, MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """``x`` where key ``k_idx`` is visible to query ``q_idx``, else ``fill``; unchanged unless
    ``MASK``. Causal: the tiles across the diagonal, j <= i (for valid rows that implies j < L);
    else the last key tile, j < L."""
    if MASK:
        if CAUSAL:
            x = tl.where(k_idx <= q_idx, x, fill)
        else:
            x = tl.where(k_idx < L, x, fill)
    return x


@triton.jit
def key_bias2(kb_base, keys, L, HAS_KEY_BIAS: tl.constexpr):
    """The key bias of ``keys`` in base-2 units (kb log2 e), padded keys 0; 0 without a bias."""
    c = key_affine(0.0, kb_base, keys, L, HAS_KEY_BIAS, 0)  # 0: EXACT mode, kb added as is
    if HAS_KEY_BIAS:
        c = c * LOG2E
    return c


@triton.jit
def row_stats(LSE, DELTA, pid_bh, T, rows, L):
    """``(lse log2 e, Delta)`` of query ``rows``: padded rows read lse = +inf, so that their P is
    exactly 0 whatever their scores, and Delta = 0."""
    base = pid_bh.to(tl.int64) * T
    lse = tl.load(LSE + base + rows, mask=rows < L, other=float("inf"))
    delta = tl.load(DELTA + base + rows, mask=rows < L, other=0.0)
    return lse * LOG2E, delta


@triton.jit
def online_softmax_pv(acc, row_max, row_sum, x, v, DOT_PRECISION: tl.constexpr):
    """One key tile of the forward on base-2 logits ``x`` (hidden pairs -inf): the running row max
    and row sum rescaled to the new max m, ``acc = acc * exp2(m_old - m) + exp2(x - m) v``. Every
    row sees key 0 in its first tile, so the max is finite from then on (no -inf - -inf)."""
    m_new = tl.maximum(row_max, tl.max(x, axis=1))
    alpha = tl.exp2(row_max - m_new)
    p = tl.exp2(x - m_new[:, None])
    row_sum = row_sum * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, row_sum


@triton.jit
def p_and_ds(
    s_rows, s_cols, dp_rows, dp_cols, a2, c2, lse2, delta, q_idx, k_idx, L,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The backward's recompute of one tile pair, shared by the dQ kernel (q, k, dO, v) and the
    dK/dV kernel (k, q, v, dO, the transposed tile): ``(p, ds)`` in float32, P = exp2(S a2 + c2 -
    lse2), dS = P (dP - Delta); ``lse2`` and ``delta`` broadcast along the query axis."""
    dp = tl.dot(dp_rows, tl.trans(dp_cols), input_precision=DOT_PRECISION)
    s = tl.dot(s_rows, tl.trans(s_cols), input_precision=DOT_PRECISION)
    # Hidden pairs masked in the exponent, not after it: their scores may lie far above lse.
    p = tl.exp2(hide(s * a2 + c2 - lse2, q_idx, k_idx, L, float("-inf"), MASK, CAUSAL))
    return p, p * (dp - delta)


# ---- tile loops (one call per stretch of tiles: the masked one with MASK) ---------------------


@triton.jit
def fwd_key_tiles(
    acc, row_max, row_sum, mx_bits, q, k_src, v_src, kb_base, b, h, lo, hi, offs_m, offs_n,
    offs_d, skt, svt, L, a2,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) of a forward query tile. The masked tiles (``hide``) keep keys past L
    out of the max |logit| and of P: they read zeros, and q . 0 is NaN for a q holding an inf."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = load_tile(k_src, b, h, start_n, keys, skt, L, offs_d, LOADS)
        v = load_tile(v_src, b, h, start_n, keys, svt, L, offs_d, LOADS)
        keys = keys[None, :]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if RETURN_MAX:
            mx_bits = max_abs_bits(mx_bits, hide(s, offs_m[:, None], keys, L, 0.0, MASK, CAUSAL))
        x = s * a2 + key_bias2(kb_base, keys, L, HAS_KEY_BIAS)
        x = hide(x, offs_m[:, None], keys, L, float("-inf"), MASK, CAUSAL)
        acc, row_max, row_sum = online_softmax_pv(acc, row_max, row_sum, x, v, DOT_PRECISION)
    return acc, row_max, row_sum, mx_bits


@triton.jit
def dq_key_tiles(
    dq, q, do, lse2, delta, k_src, v_src, kb_base, b, h, lo, hi, offs_m, offs_n, offs_d, skt, svt,
    L, a2,
    MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_KEY_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) of a dQ query tile: ``dq += dS K`` (unscaled)."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = load_tile(k_src, b, h, start_n, keys, skt, L, offs_d, LOADS)
        v = load_tile(v_src, b, h, start_n, keys, svt, L, offs_d, LOADS)
        keys = keys[None, :]
        c2 = key_bias2(kb_base, keys, L, HAS_KEY_BIAS)
        _, ds = p_and_ds(
            q, k, do, v, a2, c2, lse2, delta, offs_m[:, None], keys, L,
            MASK, CAUSAL, DOT_PRECISION,
        )  # fmt: skip
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def dkdv_query_tiles(
    dk, dv, dkb, k, v, q_src, do_src, LSE, DELTA, pid_bh, b, h, lo, hi, offs_n, offs_m, offs_d,
    sqt, sdot, T, L, a2, c2,
    MASK: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    LOADS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Query tiles [lo, hi) of a dK/dV key tile (keys ``offs_n``): ``dv += P^T dO``,
    ``dk += dS^T Q`` (unscaled) and, with a key bias, ``dkb += dS^T 1`` in a fixed order. Only
    the causal diagonal is ever masked here (MASK)."""
    for start_m in range(lo, hi, BLOCK_M):
        queries = start_m + offs_m
        q = load_tile(q_src, b, h, start_m, queries, sqt, L, offs_d, LOADS)
        do = load_tile(do_src, b, h, start_m, queries, sdot, L, offs_d, LOADS)
        lse2, delta = row_stats(LSE, DELTA, pid_bh, T, queries, L)
        # Transposed tiles (keys x queries), so P^T and dS^T feed the dots without a transpose.
        p_t, ds_t = p_and_ds(
            k, q, v, do, a2, c2, lse2[None, :], delta[None, :], queries[None, :],
            offs_n[:, None], L, MASK, True, DOT_PRECISION,
        )  # fmt: skip
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if HAS_KEY_BIAS:
            dkb += tl.sum(ds_t, axis=1)
    return dk, dv, dkb


# ---- kernels -----------------------------------------------------------------------------------
# One program per (query or key tile, b * h), as the sigmoid kernels: TMA (a constexpr) reads the
# key-side tiles (forward, dQ) or query-side tiles (dK/dV) through descriptors over the L_b valid
# rows, else masked pointer loads; a tile wholly in padding skips its loops and writes zeros. LSE
# and DELTA are contiguous (B * H, T) float32.


@triton.jit
def kv_sources(k_base, v_base, skt, svt, L, TMA: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    """What ``load_tile`` reads two (T, D) slices through: descriptors over their L valid rows
    (TMA) or the base pointers."""
    if TMA:
        k_src = tl.make_tensor_descriptor(
            k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK, HEAD_DIM]
        )
        v_src = tl.make_tensor_descriptor(
            v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK, HEAD_DIM]
        )
    else:
        k_src, v_src = k_base, v_base
    return k_src, v_src


@triton.jit
def _softmax_fwd_kernel(
    Q, K, V, Out, LSE, MX, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    H, T, T_BUCKET, mx_stride, scale,
    HEAD_DIM: tl.constexpr, RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    pid_m = tile_order(tl.program_id(0), tl.num_programs(0), CAUSAL)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a2 = scale * LOG2E
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    mx_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if start_m < L:
        k_src, v_src = kv_sources(k_base, v_base, skt, svt, L, TMA, HEAD_DIM, BLOCK_N)
        q = load_rows(Q + b64 * sqb + h * sqh, offs_m, sqt, L, offs_d)
        if CAUSAL:
            lo, hi = causal_key_split(start_m, L, BLOCK_M, BLOCK_N)
        else:
            lo, hi = L // BLOCK_N * BLOCK_N, L  # whole key tiles, then the last one masked
        acc, row_max, row_sum, mx_bits = fwd_key_tiles(
            acc, row_max, row_sum, mx_bits, q, k_src, v_src, kb_base, b, h, 0, lo, offs_m, offs_n,
            offs_d, skt, svt, L, a2, False, CAUSAL, HAS_KEY_BIAS, RETURN_MAX, DOT_PRECISION, TMA,
            BLOCK_N,
        )  # fmt: skip
        acc, row_max, row_sum, mx_bits = fwd_key_tiles(
            acc, row_max, row_sum, mx_bits, q, k_src, v_src, kb_base, b, h, lo, hi, offs_m, offs_n,
            offs_d, skt, svt, L, a2, True, CAUSAL, HAS_KEY_BIAS, RETURN_MAX, DOT_PRECISION, TMA,
            BLOCK_N,
        )  # fmt: skip
    # Padded query rows saw q = 0 (tiles past L nothing at all): zero their output and lse.
    valid = offs_m < L
    row_sum = tl.where(valid, row_sum, 1.0)
    out = tl.where(valid[:, None], acc / row_sum[:, None], 0.0)
    lse = tl.where(valid, (row_max + tl.log2(row_sum)) * LN2, 0.0)
    in_range = offs_m < T
    tl.store(Out + b64 * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=in_range[:, None])  # fmt: skip
    tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, lse, mask=in_range)
    if RETURN_MAX:  # padded rows (q = 0: NaN against a k holding an inf) stay out of the max
        mx_bits = tl.where(valid, mx_bits, 0)
        tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_m, bits_as_max(mx_bits) * scale)


@triton.jit
def _softmax_bwd_delta_kernel(
    Out, DO, DELTA, LENS, sob, soh, sot, sdob, sdoh, sdot, H, T,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Delta_i = dO_i . O_i in float32 (0 at padded rows), one program per (query tile, b * h)."""
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    o = load_rows(Out + b64 * sob + h * soh, rows, sot, L, offs_d).to(tl.float32)
    do = load_rows(DO + b64 * sdob + h * sdoh, rows, sdot, L, offs_d).to(tl.float32)
    tl.store(DELTA + pid_bh.to(tl.int64) * T + rows, tl.sum(o * do, axis=1), mask=rows < T)


@triton.jit
def _softmax_bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
    H, T, T_BUCKET, scale,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    pid_m = tile_order(tl.program_id(0), tl.num_programs(0), CAUSAL)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a2 = scale * LOG2E
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if start_m < L:
        k_src, v_src = kv_sources(k_base, v_base, skt, svt, L, TMA, HEAD_DIM, BLOCK_N)
        q = load_rows(Q + b64 * sqb + h * sqh, offs_m, sqt, L, offs_d)
        do = load_rows(DO + b64 * sdob + h * sdoh, offs_m, sdot, L, offs_d)
        lse2, delta = row_stats(LSE, DELTA, pid_bh, T, offs_m, L)
        lse2, delta = lse2[:, None], delta[:, None]
        if CAUSAL:
            lo, hi = causal_key_split(start_m, L, BLOCK_M, BLOCK_N)
        else:
            lo, hi = L // BLOCK_N * BLOCK_N, L  # as the forward: the last key tile masked
        dq = dq_key_tiles(
            dq, q, do, lse2, delta, k_src, v_src, kb_base, b, h, 0, lo, offs_m, offs_n, offs_d,
            skt, svt, L, a2, False, CAUSAL, HAS_KEY_BIAS, DOT_PRECISION, TMA, BLOCK_N,
        )  # fmt: skip
        dq = dq_key_tiles(
            dq, q, do, lse2, delta, k_src, v_src, kb_base, b, h, lo, hi, offs_m, offs_n, offs_d,
            skt, svt, L, a2, True, CAUSAL, HAS_KEY_BIAS, DOT_PRECISION, TMA, BLOCK_N,
        )  # fmt: skip
    # Padded query rows have P = 0 (lse = +inf), hence dQ = 0 already.
    tl.store(
        DQ + b64 * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
        (dq * scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T,
    )  # fmt: skip


@triton.jit
def _softmax_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
    H, T, T_BUCKET, scale,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None, DKB=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    """``DKB``: the key bias's gradient per head, a contiguous (B, H, T) float32 buffer."""
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_n = tl.program_id(0) * BLOCK_N  # natural order is heaviest first under causal masking
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    q_base = Q + b64 * sqb + h * sqh
    do_base = DO + b64 * sdob + h * sdoh
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a2 = scale * LOG2E
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if start_n < L:
        q_src, do_src = kv_sources(q_base, do_base, sqt, sdot, L, TMA, HEAD_DIM, BLOCK_M)
        k = load_rows(K + b64 * skb + h * skh, offs_n, skt, L, offs_d)
        v = load_rows(V + b64 * svb + h * svh, offs_n, svt, L, offs_d)
        # Padded keys (read as zeros) get -inf: P = 0 exactly, so their dK, dV and d kb are 0.
        c2 = tl.where(offs_n[:, None] < L, key_bias2(kb_base, offs_n[:, None], L, HAS_KEY_BIAS),
                      float("-inf"))  # fmt: skip
        lo = 0
        if CAUSAL:
            lo, diag_end = causal_query_split(start_n, L, BLOCK_M, BLOCK_N)
            dk, dv, dkb = dkdv_query_tiles(
                dk, dv, dkb, k, v, q_src, do_src, LSE, DELTA, pid_bh, b, h, lo, diag_end, offs_n,
                offs_m, offs_d, sqt, sdot, T, L, a2, c2, True, HAS_KEY_BIAS, DOT_PRECISION, TMA,
                BLOCK_M,
            )  # fmt: skip
            lo = diag_end
        dk, dv, dkb = dkdv_query_tiles(
            dk, dv, dkb, k, v, q_src, do_src, LSE, DELTA, pid_bh, b, h, lo, L, offs_n, offs_m,
            offs_d, sqt, sdot, T, L, a2, c2, False, HAS_KEY_BIAS, DOT_PRECISION, TMA, BLOCK_M,
        )  # fmt: skip
    in_range = offs_n[:, None] < T
    tl.store(
        DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
        (dk * scale).to(DK.dtype.element_ty), mask=in_range,
    )  # fmt: skip
    tl.store(
        DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
        dv.to(DV.dtype.element_ty), mask=in_range,
    )  # fmt: skip
    if HAS_KEY_BIAS:
        tl.store(DKB + pid_bh.to(tl.int64) * T + offs_n, dkb, mask=offs_n < T)


# ---- launcher (the sigmoid kernel's configs, autotune keys and launch; docs/BENCHMARKS.md) -----

DELTA_BLOCK_M = 64  # rows per program of the Delta kernel: a short, memory-bound pass, not tuned


def _common_args(D: int, dtype: torch.dtype, tma: bool) -> dict:
    return {
        "HEAD_DIM": D,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "TMA": tma,
    }


def _forward(q, k, v, lengths, scale, return_max, tma, causal=False, key_bias=None):
    """``(out, lse, max_bh)`` on inputs with unit stride along D; lse (B, H, T) float32."""
    B, H, T, D = q.shape
    if tma and not interpreting():
        triton.set_allocator(_device_allocator)
    out = _empty_bthd_as_bhtd(q)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)  # every row written
    mx, n_mx = _max_buffer(q, return_max)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    args = _kernel_args((q, k, v, out), (lse, mx), lengths, H, T, n_mx, scale)
    kwargs = {
        "RETURN_MAX": return_max,
        **_common_args(D, q.dtype, tma),
        **_mask_and_bias_args(causal, key_bias),
    }
    _launch(_softmax_fwd_kernel, "fwd", q, grid, args, kwargs)
    max_bh = mx.amax(dim=1).view(B, H) if return_max else mx.new_empty(0)
    return out, lse, max_bh


def _delta(out, do, lengths) -> torch.Tensor:
    """Delta = rowsum(dO * O), (B, H, T) float32: one short kernel, fixed order per row."""
    B, H, T, D = out.shape
    delta = torch.empty(B, H, T, dtype=torch.float32, device=out.device)
    kernel = _softmax_bwd_delta_kernel
    kernel = interpreted(kernel) if interpreting() else compiled(kernel)
    kernel[(cdiv(T, DELTA_BLOCK_M), B * H)](
        out, do, delta, lengths, *out.stride()[:3], *do.stride()[:3], H, T,
        HEAD_DIM=D, BLOCK_M=DELTA_BLOCK_M,
    )  # fmt: skip
    return delta


def _backward(do, q, k, v, out, lse, lengths, scale, tma, causal=False, key_bias=None, dkb=None):
    """Delta, then the dQ and dK/dV kernels: ``(dq, dk, dv)``, and the key bias's gradient per head
    written into ``dkb`` (a contiguous (B, H, T) float32 buffer) when there is a key bias."""
    B, H, T, D = q.shape
    if tma and not interpreting():
        triton.set_allocator(_device_allocator)
    delta = _delta(out, do, lengths)
    kwargs = {**_common_args(D, q.dtype, tma), **_mask_and_bias_args(causal, key_bias)}
    dq = _empty_bthd_as_bhtd(q)
    args = _kernel_args((q, k, v, do, dq), (lse, delta), lengths, H, T, scale)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    _launch(_softmax_bwd_dq_kernel, "dq", q, grid, args, kwargs)
    dk, dv = _empty_bthd_as_bhtd(k), _empty_bthd_as_bhtd(v)
    args = _kernel_args((q, k, v, do, dk, dv), (lse, delta), lengths, H, T, scale)
    grid = lambda meta: (cdiv(T, meta["BLOCK_N"]), B * H)
    dkb_arg = {} if key_bias is None else {"DKB": dkb}
    _launch(_softmax_bwd_dkdv_kernel, "dkdv", q, grid, args, {**kwargs, **dkb_arg})
    return dq, dk, dv


def forward_auto(q, k, v, lengths, scale, return_max, causal=False, key_bias=None):
    """The forward with the op's choices (TMA loads where the sigmoid op takes them, ``use_tma``):
    ``(out, lse, max_bh)``."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    return _forward(q, k, v, lengths, scale, return_max, use_tma(q, k, v), causal, key_bias)


def backward_auto(do, q, k, v, out, lse, lengths, scale, causal=False, key_bias=None):
    """The backward with the op's choices: ``(dq, dk, dv, dkb)``, dkb the key bias's gradient per
    head, (B, H, T) float32, or None without a key bias."""
    do, q, k, v, out = (last_dim_contiguous(t) for t in (do, q, k, v, out))
    B, H, T, _ = q.shape
    dkb = None
    if key_bias is not None:
        dkb = torch.empty(B, H, T, dtype=torch.float32, device=q.device)  # every entry written
    tma = use_tma(q, k, v, do)
    grads = _backward(do, q, k, v, out, lse, lengths, scale, tma, causal, key_bias, dkb)
    return (*grads, dkb)


# ---- torch.library ops (compile-friendly) + autograd --------------------------------------------
# As the sigmoid op: opaque ``custom_op``s under torch.compile, a cheaper autograd Function in
# eager. The forward op returns lse too (saved for the backward; not differentiable).


@torch.library.custom_op("stabilitylab::softmax_attention_fwd", mutates_args=())
def _fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    return_max: bool,
    causal: bool = False,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_lengths_at_launch(lengths, q.shape[2])  # torch.compile's tracing skipped it
    return forward_auto(q, k, v, lengths, scale, return_max, causal, key_bias)


@torch.library.custom_op("stabilitylab::softmax_attention_bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    causal: bool = False,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dkb)``; dkb empty without a key bias (an op returns tensors only)."""
    check_lengths_at_launch(lengths, q.shape[2])
    dq, dk, dv, dkb = backward_auto(do, q, k, v, out, lse, lengths, scale, causal, key_bias)
    return dq, dk, dv, (q.new_empty(0, dtype=torch.float32) if dkb is None else dkb)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, lengths, scale, return_max, causal=False, key_bias=None):
    B, H, T, _ = q.shape
    max_bh = q.new_empty((B, H) if return_max else (0,), dtype=torch.float32)
    return _empty_bthd_as_bhtd(q), q.new_empty(B, H, T, dtype=torch.float32), max_bh


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, out, lse, lengths, scale, causal=False, key_bias=None):
    dkb = q.new_empty(q.shape[:3] if key_bias is not None else (0,), dtype=torch.float32)
    return (*(_empty_bthd_as_bhtd(t) for t in (q, k, v)), dkb)


def _input_grads(dq, dk, dv, dkb, key_bias, n_inputs: int) -> tuple:
    """The gradients of the ops' inputs (q, k, v, then none for lengths and the numbers, then the
    key bias's), for the ``n_inputs`` inputs a caller passed."""
    grads = (dq, dk, dv, None, None, None, None)
    return (*grads, None if key_bias is None else dkb)[:n_inputs]


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, lengths, scale, _, causal, key_bias = inputs
    out, lse, _ = output
    ctx.save_for_backward(q, k, v, out, lse, lengths, key_bias)
    ctx.args = (scale, causal)


def _backward_op(ctx, d_out, _d_lse, _d_max):
    q, k, v, out, lse, lengths, key_bias = ctx.saved_tensors
    scale, causal = ctx.args
    dq, dk, dv, dkb = _bwd_op(d_out, q, k, v, out, lse, lengths, scale, causal, key_bias)
    return _input_grads(dq, dk, dv, dkb, key_bias, 8)


_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


class _EagerSoftmaxAttention(torch.autograd.Function):
    """The same launches as the ops, for eager mode (no custom-op dispatch cost per call)."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, scale, return_max, causal=False, key_bias=None):
        out, lse, max_bh = forward_auto(q, k, v, lengths, scale, return_max, causal, key_bias)
        ctx.save_for_backward(q, k, v, out, lse, lengths, key_bias)
        ctx.args = (scale, causal)
        ctx.mark_non_differentiable(lse, max_bh)
        return out, lse, max_bh

    @staticmethod
    def backward(ctx, d_out, _d_lse, _d_max):
        q, k, v, out, lse, lengths, key_bias = ctx.saved_tensors
        scale, causal = ctx.args
        dq, dk, dv, dkb = backward_auto(d_out, q, k, v, out, lse, lengths, scale, causal, key_bias)
        return _input_grads(dq, dk, dv, dkb, key_bias, len(ctx.needs_input_grad))


# ---- public function ---------------------------------------------------------------------------


def softmax_attention(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    key_bias_BHT: torch.Tensor | None = None,
    return_max_logit: bool = False,
    return_lse: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(out_BHTD, max_logit_BH | None)``, and ``lse_BHT`` (float32, detached) after them when
    ``return_lse``; see the module docstring for formula and layout.

    ``causal``: query i sees keys j <= i. ``key_bias_BT`` (shared by the heads) or
    ``key_bias_BHT`` (one per head), at most one: added to every query's logit for key j, computed
    in float32, differentiable. The output is a (B, H, T, D) view of (B, T, H, D) memory. Run to
    run the same inputs give the same bits (no atomics; under
    ``torch.use_deterministic_algorithms`` also the same launch configs, ``_launch``).
    """
    named = {"q_BHTD": q_BHTD, "k_BHTD": k_BHTD, "v_BHTD": v_BHTD}
    check_attention_inputs(named, lengths_B, scale, None, causal)
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    key_bias = check_key_bias(q_BHTD, key_bias_BT, key_bias_BHT)
    scale = 1.0 / math.sqrt(q_BHTD.shape[-1]) if scale is None else float(scale)
    fn = _fwd_op if torch.compiler.is_compiling() else _EagerSoftmaxAttention.apply
    out_BHTD, lse_BHT, max_BH = fn(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, scale, return_max_logit, causal, key_bias
    )
    result = (out_BHTD, max_BH.detach() if return_max_logit else None)
    return (*result, lse_BHT.detach()) if return_lse else result
