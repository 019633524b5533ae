"""Sigmoid attention in Triton: forward (fused max|logit|), dQ, dK/dV; padding, causal, key bias.

    out_i = sum_{j visible} sigmoid(scale q_i . k_j + b + kb_j) v_j; padded query rows are 0
    visible: j < L_b, and j <= i if causal; b = -log(L_b) (bias=None) or the float given; kb an
    optional per-key bias (B, H, T), a gate's log(g + eps); max_BH = max over visible pairs of
    scale |q_i . k_j|, no bias of either kind, float32, NaN if any such score is NaN
    backward, P = sigmoid(S): dV = P^T dO, dP = dO V^T, dS = P (1 - P) dP, dQ = scale dS K,
    dK = scale dS^T Q, d kb_j = sum_i dS_ij (per head)
    fused gate (opt-in, g_j in [0, 1] per key): kb_j = log(g_j + 1e-8) and the values g_j v_j,
    both inside the kernels; dP = g_j dO v_j^T, dV_j = g_j (P^T dO)_j,
    d g_j = d kb_j / (g_j + 1e-8) + v_j . (P^T dO)_j (per head)

Layout: q/k/v_BHTD, any (b, h, t) strides, unit stride along D; lengths_B, right padding; maths:
kernels/reference.py. Loops end at the last valid tile (work ~ sum L^2) and, if causal, at the
diagonal; only tiles across it are masked. The backward recomputes S per tile: dQ over query tiles,
dK/dV and d kb over key tiles, no atomics. Unpadded 16-bit batches at head dim 128: the kernels of
sigmoid_attention_dense.py. Limits: head dim 64 or 128; bf16, fp16, fp32 (tests); on CPU only in
Triton's interpreter (exact sigmoid). Measured choices: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import functools
import importlib
import math

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.reference import sigmoid_attention_reference  # noqa: F401  (the maths)
from stabilitylab.kernels.triton_support import (
    Tuned,
    bits_as_max,
    capability,
    cdiv,
    check_attention_inputs,
    check_key_bias,
    check_lengths_at_launch,
    interpreted,
    interpreting,
    last_dim_contiguous,
    lengths_all_full,
    max_abs_bits,
    persistent_grid,
    seq_bucket,
    specialization,
)

# Sigmoid modes (constexpr SIGMOID). TANH_F32 evaluates 0.5 tanh(x / 2) + 0.5 with one MUFU op; the
# packed tanh.approx.bf16x2 is not used: near x = -log n, where most scores sit, 0.5 + 0.5 t in
# bf16 leaves p no significant bits (max abs error 0.17 vs 0.004, docs/LOG.md).
EXACT, TANH_F32 = 0, 1
# The tile helpers' LOADS for the dense kernels' rank-4 descriptors built on the host; the general
# kernels pass their TMA flag (False: masked pointer loads, True: descriptors built per (b, h)).
HOST_TMA = tl.constexpr(2)
# The fused gate's epsilon in log(g + eps), the KV-eviction paper's (stabilitylab/model.py's
# GATE_EPS; kernels import nothing from the model).
GATE_EPS = tl.constexpr(1e-8)

# ---- tile helpers (inlined into the kernels here and in sigmoid_attention_dense.py) -----------


@triton.jit
def tanh_approx(x):
    """``tanh.approx.f32``: inline PTX, so never reached in the interpreter (the launcher runs the
    exact mode there)."""
    return tl.inline_asm_elementwise(
        "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def in_registers(x):
    """``x`` through an opaque register move: a wgmma then takes it as its A operand from registers
    instead of reading it from shared memory on every iteration (``use_a_regs``). Inline PTX."""
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=True,
        pack=32 // x.dtype.primitive_bitwidth,
    )  # fmt: skip


@triton.jit
def score_affine(L, scale, bias, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr):
    """``(a, c)`` with ``a s + c`` the argument of the sigmoid (exact mode) or of tanh(x / 2) (the
    1/2 folded into the per-score multiply-add), for raw scores s = q . k of a sequence of L."""
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    return a_s, c_s


@triton.jit
def key_affine(c_s, kb_base, keys, L, HAS_KEY_BIAS: tl.constexpr, SIGMOID: tl.constexpr):
    """The additive part of the sigmoid's argument for the keys ``keys`` (indices shaped as the
    score tile's key axis, (1, n) or (n, 1)): ``c_s`` plus their bias, halved in tanh mode as c_s
    is; padded keys read 0. Without a key bias, the scalar ``c_s``."""
    if HAS_KEY_BIAS:
        kb = tl.load(kb_base + keys, mask=keys < L, other=0.0)
        if SIGMOID == 0:
            c = c_s + kb
        else:
            c = c_s + 0.5 * kb
    else:
        c = c_s
    return c


@triton.jit
def gate_affine(c_s, g_base, keys, L, SIGMOID: tl.constexpr):
    """The fused gate of the keys ``keys`` (shaped as in ``key_affine``): ``(c, g)``, c = c_s plus
    log(g + GATE_EPS), halved in tanh mode as c_s is, and g itself. Padded keys read g = 0: a
    finite bias (-18.4) and a zero weight p g."""
    g = tl.load(g_base + keys, mask=keys < L, other=0.0)
    kb = tl.log(g + GATE_EPS)
    if SIGMOID == 0:
        c = c_s + kb
    else:
        c = c_s + 0.5 * kb
    return c, g


@triton.jit
def ds_scale(scale, SIGMOID: tl.constexpr):
    """The factor on dQ and dK: ``scale``, and the 1/4 of p (1 - p) = (1 - t^2) / 4 in tanh mode."""
    return scale if SIGMOID == 0 else 0.25 * scale


@triton.jit
def hide_future(x, q_idx, k_idx, fill, MASK: tl.constexpr):
    """``x`` where key ``k_idx`` is visible to query ``q_idx`` (k <= q), else ``fill``; unchanged
    unless ``MASK`` (set for the causal tiles that straddle the diagonal, and only those)."""
    if MASK:
        x = tl.where(k_idx <= q_idx, x, fill)
    return x


@triton.jit
def load_rows(base, rows, stride, L, offs_d):
    """Rows ``rows`` of a (T, D) slice at ``base``; rows >= L (padding or past T) read as zeros."""
    return tl.load(
        base + rows[:, None] * stride + offs_d[None, :], mask=rows[:, None] < L, other=0.0
    )


@triton.jit
def load_tile(src, b, h, start, rows, stride, L, offs_d, LOADS: tl.constexpr):
    """Rows ``rows`` (= start + arange) of head (b, h) from ``src``: the head's base pointer (LOADS
    False), its descriptor (True) or the whole tensor's (HOST_TMA). Rows past the valid ones read
    as zeros on every path."""
    if LOADS == HOST_TMA:
        tile = src.load([b, h, start, 0]).reshape(rows.shape[0], offs_d.shape[0])
    elif LOADS:
        tile = src.load([start, 0])
    else:
        tile = load_rows(src, rows, stride, L, offs_d)
    return tile


@triton.jit
def causal_key_split(start_m, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(diag, end)`` for query tile ``start_m``: key tiles [0, diag) lie below the diagonal (all
    visible), [diag, end) straddle it (masked), those from ``end`` lie above it (never visited)."""
    return start_m // BLOCK_N * BLOCK_N, tl.minimum(start_m + BLOCK_M, L)


@triton.jit
def causal_query_split(start_n, L, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(lo, diag_end)`` for key tile ``start_n``: query tiles before ``lo`` see none of its keys
    (never visited), [lo, diag_end) straddle the diagonal (masked), the rest see all of them."""
    lo = start_n // BLOCK_M * BLOCK_M
    return lo, tl.minimum(tl.cdiv(start_n + BLOCK_N, BLOCK_M) * BLOCK_M, L)


@triton.jit
def tile_order(pid, n, CAUSAL: tl.constexpr):
    """Program ``pid``'s tile of ``n``: under causal masking the query tiles with the most keys
    first, so that the last wave of programs is a short one."""
    if CAUSAL:
        pid = n - 1 - pid
    return pid


@triton.jit
def accumulate_pv(
    acc, mx_bits, s, v, a_s, c, q_idx, k_idx, L,
    MASK: tl.constexpr, PAST_L: tl.constexpr, SIGMOID: tl.constexpr, RETURN_MAX: tl.constexpr,
    DOT_PRECISION: tl.constexpr, g=None, HAS_GATE: tl.constexpr = False,
):  # fmt: skip
    """One key tile of the forward: ``acc += sigmoid(a s + c) v`` and the running max |s| over
    visible pairs (``hide_future``). ``PAST_L``: the tile holds keys past L, which read as zeros:
    their score q . 0 is 0, but NaN for a q holding an inf (0 * inf), so it is set to 0 here
    (p v stays 0 as v = 0), and padding never reaches the output or the max. ``HAS_GATE``: p g
    in place of p (the keys' gate ``g``), at no extra operation per score: g / (1 + e^-x) in
    exact mode, t (g / 2) + g / 2 in tanh mode."""
    if PAST_L:
        s = tl.where(k_idx < L, s, 0.0)
    if RETURN_MAX:
        mx_bits = max_abs_bits(mx_bits, hide_future(s, q_idx, k_idx, 0.0, MASK))
    x = s * a_s + c
    if SIGMOID == 0:
        if HAS_GATE:
            p = g / (1.0 + tl.exp(-x))
        else:
            p = 1.0 / (1.0 + tl.exp(-x))
    else:
        if HAS_GATE:
            half_g = 0.5 * g
            p = tanh_approx(x) * half_g + half_g
        else:
            p = 0.5 * tanh_approx(x) + 0.5
    p = hide_future(p, q_idx, k_idx, 0.0, MASK)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, mx_bits


@triton.jit
def p_and_ds(
    s_rows, s_cols, dp_rows, dp_cols, a_s, c, q_idx, k_idx,
    MASK: tl.constexpr, SIGMOID: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """The backward's recompute of one tile pair, shared by the dQ kernel (q, k, dO, v) and the
    dK/dV kernel (k, q, v, dO, the transposed tile): ``(p, ds)`` in float32 from
    S = s_rows s_cols^T and dP = dp_rows dp_cols^T. dP needs no P: it is issued first, so its
    wgmma runs while the MUFU evaluates the sigmoid. In tanh mode ds = (1 - t^2) dP = 4 p (1 - p) dP
    (``ds_scale`` holds the 1/4), so a kernel that needs no p never forms it. Padded rows on
    either side are zero in dp_rows or dp_cols, hence their ds is zero; a hidden pair gets p = 0
    (t = -1), hence ds = 0: one select serves both."""
    dp = tl.dot(dp_rows, tl.trans(dp_cols), input_precision=DOT_PRECISION)
    s = tl.dot(s_rows, tl.trans(s_cols), input_precision=DOT_PRECISION)
    x = s * a_s + c
    if SIGMOID == 0:
        p = hide_future(1.0 / (1.0 + tl.exp(-x)), q_idx, k_idx, 0.0, MASK)
        ds = (p - p * p) * dp
    else:
        t = hide_future(tanh_approx(x), q_idx, k_idx, -1.0, MASK)
        p = 0.5 * t + 0.5
        ds = (1.0 - t * t) * dp
    return p, ds


# ---- tile loops (one call per stretch of tiles: the causal diagonal's with MASK) ---------------


@triton.jit
def fwd_key_tiles(
    acc, mx_bits, qk, q, k_src, v_src, kb_base, b, h, lo, hi, offs_m, offs_n, offs_d, skt, svt, L,
    a_s, c_s,
    MASK: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr,
    BLOCK_N: tl.constexpr, PAST_L: tl.constexpr = False, HAS_GATE: tl.constexpr = False,
):  # fmt: skip
    """Key tiles [lo, hi) of a forward query tile; ``qk`` holds tile lo's scores on entry and
    tile hi's on exit. ``PAST_L``: the tiles hold keys past L (``accumulate_pv``). ``HAS_GATE``:
    ``kb_base`` points to the keys' gate g (``gate_affine``), not to a key bias. The scores of
    key tile j+1 (an asynchronous wgmma on Hopper) are issued
    before the sigmoid of tile j, so the MUFU works while the tensor cores do: per score the two
    products cost 4 D flops (~990 TFLOPS dense bf16 on an H200) and the sigmoid one MUFU op
    (~3.9 T/s), about as long at D = 64. The tile past the last valid key reads zeros; its scores
    are discarded."""
    for start_n in range(lo, hi, BLOCK_N):
        rows_k = start_n + BLOCK_N + offs_n
        keys = start_n + offs_n
        k = load_tile(k_src, b, h, start_n + BLOCK_N, rows_k, skt, L, offs_d, LOADS)
        v = load_tile(v_src, b, h, start_n, keys, svt, L, offs_d, LOADS)
        keys = keys[None, :]
        if HAS_GATE:
            c, g = gate_affine(c_s, kb_base, keys, L, SIGMOID)
        else:
            c = key_affine(c_s, kb_base, keys, L, HAS_KEY_BIAS, SIGMOID)
            g = None
        qk_now = qk
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        acc, mx_bits = accumulate_pv(
            acc, mx_bits, qk_now, v, a_s, c, offs_m[:, None], keys, L,
            MASK, PAST_L, SIGMOID, RETURN_MAX, DOT_PRECISION, g, HAS_GATE,
        )  # fmt: skip
    return acc, mx_bits, qk


@triton.jit
def dq_key_tiles(
    dq, q, do, k_src, v_src, kb_base, b, h, lo, hi, offs_m, offs_n, offs_d, skt, svt, L, a_s, c_s,
    MASK: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_GATE: tl.constexpr = False,
):  # fmt: skip
    """Key tiles [lo, hi) of a dQ query tile: ``dq += dS K`` (unscaled). ``HAS_GATE``: the values
    are g v, so dP = g dO V^T: dS times g per key (one multiply per score)."""
    for start_n in range(lo, hi, BLOCK_N):
        keys = start_n + offs_n
        k = load_tile(k_src, b, h, start_n, keys, skt, L, offs_d, LOADS)
        v = load_tile(v_src, b, h, start_n, keys, svt, L, offs_d, LOADS)
        keys = keys[None, :]
        if HAS_GATE:
            c, g = gate_affine(c_s, kb_base, keys, L, SIGMOID)
        else:
            c = key_affine(c_s, kb_base, keys, L, HAS_KEY_BIAS, SIGMOID)
        _, ds = p_and_ds(q, k, do, v, a_s, c, offs_m[:, None], keys, MASK, SIGMOID, DOT_PRECISION)
        if HAS_GATE:
            ds = ds * g
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def dkdv_query_tiles(
    dk, dv, dkb, k, v, q_src, do_src, b, h, lo, hi, offs_n, offs_m, offs_d, sqt, sdot, L, a_s, c,
    MASK: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, LOADS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Query tiles [lo, hi) of a dK/dV key tile (keys ``offs_n``): ``dv += P^T dO``,
    ``dk += dS^T Q`` (unscaled) and, with a key bias, ``dkb += dS^T 1`` (its row sums: each key's
    gradient, reduced here in a fixed order instead of by atomics)."""
    for start_m in range(lo, hi, BLOCK_M):
        queries = start_m + offs_m
        q = load_tile(q_src, b, h, start_m, queries, sqt, L, offs_d, LOADS)
        do = load_tile(do_src, b, h, start_m, queries, sdot, L, offs_d, LOADS)
        # Transposed tiles (keys x queries), so P^T and dS^T feed the dots without a transpose.
        p_t, ds_t = p_and_ds(
            k, q, v, do, a_s, c, queries[None, :], offs_n[:, None],
            MASK, SIGMOID, DOT_PRECISION,
        )  # fmt: skip
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        if HAS_KEY_BIAS:
            dkb += tl.sum(ds_t, axis=1)
    return dk, dv, dkb


# ---- kernels -----------------------------------------------------------------------------------
# One program per (query or key tile, b * h). TMA (a constexpr) reads tiles through one tensor
# descriptor per (b, h) over the L_b valid rows, which the hardware zero-fills past L_b; else
# masked pointer loads. A tile wholly in padding skips its loops and writes zeros. The key bias
# (KB, strides skbb / skbh, unit stride along T) and CAUSAL are trailing arguments with neutral
# defaults: without them each kernel compiles as it would without those features.


@triton.jit
def _sigmoid_fwd_kernel(
    Q, K, V, Out, MX, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    H, T, T_BUCKET, mx_stride, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    A_REGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False,
):  # fmt: skip
    pid_m = tile_order(tl.program_id(0), tl.num_programs(0), CAUSAL)
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
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    mx_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    if start_m < L:
        if TMA:  # built only when the tile has work
            q_desc = tl.make_tensor_descriptor(
                q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
            k_src = tl.make_tensor_descriptor(
                k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
            v_src = tl.make_tensor_descriptor(
                v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
            q = q_desc.load([start_m, 0])
        else:
            k_src, v_src = k_base, v_base
            q = load_rows(q_base, offs_m, sqt, L, offs_d)
        if A_REGS:
            q = in_registers(q)
        k0 = load_tile(k_src, b, h, 0, offs_n, skt, L, offs_d, TMA)  # ahead of the loop
        qk = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
        # Causal: below the diagonal, then across it (masked; for a valid row that hides every
        # key past L too). Else the whole key tiles, then the last one, which holds keys past L.
        if CAUSAL:
            diag, end = causal_key_split(start_m, L, BLOCK_M, BLOCK_N)
        else:
            diag, end = L // BLOCK_N * BLOCK_N, L
        acc, mx_bits, qk = fwd_key_tiles(
            acc, mx_bits, qk, q, k_src, v_src, kb_base, b, h, 0, diag, offs_m, offs_n, offs_d,
            skt, svt, L, a_s, c_s, False, HAS_KEY_BIAS, SIGMOID, RETURN_MAX, DOT_PRECISION, TMA,
            BLOCK_N, False, HAS_GATE,
        )  # fmt: skip
        acc, mx_bits, qk = fwd_key_tiles(
            acc, mx_bits, qk, q, k_src, v_src, kb_base, b, h, diag, end, offs_m, offs_n,
            offs_d, skt, svt, L, a_s, c_s, CAUSAL, HAS_KEY_BIAS, SIGMOID, RETURN_MAX,
            DOT_PRECISION, TMA, BLOCK_N, not CAUSAL, HAS_GATE,
        )  # fmt: skip
    # Padded query rows saw q = 0, so acc holds sigmoid(b) * sum(v) there (NaN for a k holding
    # an inf): zero them, and keep them out of the max.
    valid = offs_m < L
    acc = tl.where(valid[:, None], acc, 0.0)
    tl.store(o_base + offs_m[:, None] * sot + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
    if RETURN_MAX:
        tl.store(mx_base + pid_m, bits_as_max(tl.where(valid, mx_bits, 0)) * scale)


# The backward kernels issue dP ahead of the sigmoid (``p_and_ds``), not the next tile's scores as
# the forward does: with scores in flight across the loop's back edge, ptxas serializes every
# wgmma of the loop (docs/BENCHMARKS.md, Levers).


@triton.jit
def _sigmoid_bwd_dq_kernel(
    Q, K, V, DO, DQ, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot, sdqb, sdqh, sdqt,
    H, T, T_BUCKET, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False,
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
    q_base = Q + b64 * sqb + h * sqh
    do_base = DO + b64 * sdob + h * sdoh
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if start_m < L:
        if TMA:
            k_src = tl.make_tensor_descriptor(
                k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
            v_src = tl.make_tensor_descriptor(
                v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
        else:
            k_src, v_src = k_base, v_base
        q = load_rows(q_base, offs_m, sqt, L, offs_d)
        do = load_rows(do_base, offs_m, sdot, L, offs_d)
        if CAUSAL:
            diag, end = causal_key_split(start_m, L, BLOCK_M, BLOCK_N)
        else:
            diag = L
        dq = dq_key_tiles(
            dq, q, do, k_src, v_src, kb_base, b, h, 0, diag, offs_m, offs_n, offs_d, skt, svt, L,
            a_s, c_s, False, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, TMA, BLOCK_N, HAS_GATE,
        )  # fmt: skip
        if CAUSAL:
            dq = dq_key_tiles(
                dq, q, do, k_src, v_src, kb_base, b, h, diag, end, offs_m, offs_n, offs_d, skt,
                svt, L, a_s, c_s, True, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, TMA, BLOCK_N,
                HAS_GATE,
            )  # fmt: skip
    # Padded query rows have dO = 0, hence dQ = 0 already.
    dq_scale = ds_scale(scale, SIGMOID)
    tl.store(
        DQ + b64 * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
        (dq * dq_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T,
    )  # fmt: skip


@triton.jit
def _sigmoid_bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
    H, T, T_BUCKET, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None, DKB=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
    HAS_GATE: tl.constexpr = False,
):  # fmt: skip
    """``DKB``: the key bias's gradient per head, a contiguous (B, H, T) float32 buffer.
    ``HAS_GATE`` (with HAS_KEY_BIAS): KB holds the gate g, the bias is log(g + eps) and the values
    g v; dP takes g v (scaled once per program), dV = g P^T dO, and DKB receives the gate's
    gradient per head, d kb / (g + eps) + v . (P^T dO)."""
    pid_n = tl.program_id(0)  # natural order is heaviest first under causal masking too
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
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_GATE:
        g_n = tl.load(kb_base + offs_n, mask=offs_n < L, other=0.0)
        dg_v = tl.zeros((BLOCK_N,), dtype=tl.float32)  # v . (P^T dO) per key
    if start_n < L:
        if TMA:
            q_src = tl.make_tensor_descriptor(
                q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
            do_src = tl.make_tensor_descriptor(
                do_base, shape=[L, HEAD_DIM], strides=[sdot, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
        else:
            q_src, do_src = q_base, do_base
        k = load_rows(k_base, offs_n, skt, L, offs_d)
        v = load_rows(v_base, offs_n, svt, L, offs_d)
        if HAS_GATE:  # dP = dO (g v)^T: the values scaled once, at their dtype (as g * v outside)
            c, g = gate_affine(c_s, kb_base, offs_n[:, None], L, SIGMOID)
            v_dp = (v.to(tl.float32) * g).to(v.dtype)
        else:
            c = key_affine(c_s, kb_base, offs_n[:, None], L, HAS_KEY_BIAS, SIGMOID)
            v_dp = v
        if CAUSAL:
            lo, diag_end = causal_query_split(start_n, L, BLOCK_M, BLOCK_N)
            dk, dv, dkb = dkdv_query_tiles(
                dk, dv, dkb, k, v_dp, q_src, do_src, b, h, lo, diag_end, offs_n, offs_m, offs_d,
                sqt, sdot, L, a_s, c, True, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, TMA, BLOCK_M,
            )  # fmt: skip
        else:
            diag_end = 0
        dk, dv, dkb = dkdv_query_tiles(
            dk, dv, dkb, k, v_dp, q_src, do_src, b, h, diag_end, L, offs_n, offs_m, offs_d, sqt,
            sdot, L, a_s, c, False, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, TMA, BLOCK_M,
        )  # fmt: skip
        if HAS_GATE:
            dg_v = tl.sum(v.to(tl.float32) * dv, axis=1)
    # Padded key rows saw k = 0 (and v = 0): zero their dK and dV on the way out. Their dS is zero
    # (dP = dO v^T = 0), so their key-bias gradient is too.
    dk_scale = ds_scale(scale, SIGMOID)
    valid = offs_n[:, None] < L
    in_range = offs_n[:, None] < T
    tl.store(
        DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
        tl.where(valid, dk * dk_scale, 0.0).to(DK.dtype.element_ty), mask=in_range,
    )  # fmt: skip
    if HAS_GATE:
        dv = dv * g_n[:, None]
    tl.store(
        DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
        tl.where(valid, dv, 0.0).to(DV.dtype.element_ty), mask=in_range,
    )  # fmt: skip
    if HAS_KEY_BIAS:
        dkb_base = DKB + pid_bh.to(tl.int64) * T
        if HAS_GATE:  # padded keys: dkb = 0, v = 0 and g = 0, so 0
            dg = dkb * ds_scale(1.0, SIGMOID) / (g_n + GATE_EPS) + dg_v
            tl.store(dkb_base + offs_n, dg, mask=offs_n < T)
        else:
            tl.store(dkb_base + offs_n, dkb * ds_scale(1.0, SIGMOID), mask=offs_n < T)


# ---- launch configs and choices ----------------------------------------------------------------
# Production configs per architecture; the GPU tests run these same lists. The interpreter runs one
# small config (it is slow and tl.dot needs tiles of at least 16).

INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


@functools.cache  # called on every forward (the max-logit buffer size): build the list once
def _configs(
    kind: str, cap: tuple[int, int], fp32: bool = False, dense: bool = False
) -> tuple[triton.Config, ...]:  # fmt: skip
    """``kind``: fwd (BLOCK_M queries x BLOCK_N keys per step), dq (same), dkdv (BLOCK_N keys
    fixed).
    ``dense``: the same tiles for the kernels of unpadded batches, whose host-built descriptors
    take their blocks from the config (``set_blocks``, a pre-hook).

    float32 (a testing dtype) gets small tiles of its own: the 16-bit tiles at 4 bytes a value
    overflow shared memory at head dim 128, and compiling them took minutes on the H200."""
    if fp32:
        blocks = {"fwd": [(64, 32, 4, 2)], "dq": [(64, 32, 4, 2)], "dkdv": [(32, 64, 4, 2)]}[kind]
    elif cap[0] >= 9:
        # (BLOCK_M, BLOCK_N, num_warps, num_stages); three each keeps first-call autotuning short.
        # Chosen per kernel with experiments/bench/sweep_configs.py: dK/dV wants 64 x 64 tiles on
        # 4 warps at head dim 64 and 64 x 128 on 8 warps at 128.
        blocks = {
            "fwd": [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3)],
            "dq": [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
            "dkdv": [(64, 128, 8, 3), (64, 64, 4, 3), (64, 64, 4, 2)],
        }[kind]
    else:
        blocks = {
            "fwd": [(128, 64, 4, 2), (64, 64, 4, 2), (64, 32, 4, 2)],
            "dq": [(64, 64, 4, 2), (64, 32, 4, 2)],
            "dkdv": [(32, 64, 4, 2), (64, 64, 4, 2)],
        }[kind]
    hook = _dense().set_blocks if dense else None
    return tuple(
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=hook)
        for m, n, w, s in blocks
    )


# TMA loads in all three kernels from T = 4096 up, where they beat pointer loads; below, building a
# descriptor per program costs more than it saves, most of all under heavy padding (H200,
# 2026-11-29: T = 2048 with 50% padding, head dim 128: 212 vs 377 TFLOPS; docs/BENCHMARKS.md).
TMA_MIN_T = 4096
# q from registers in the forward's q k^T (``in_registers``) where it paid: TMA loads at head dim
# 128. A 64 x 64 x 16 wgmma with both operands in shared memory reads about the 128 B per cycle an
# SM's shared memory delivers while the TMA refills it. With pointer loads, at head dim 64 and in
# the backward kernels it lost (docs/BENCHMARKS.md, Levers).
FWD_A_REGS_HEAD_DIMS = (128,)
# The dense kernels at head dim 128 only: there one program fills an SM and builds its three
# descriptors alone, a fixed cost that shows at T <= 4K; at head dim 64 two programs share an SM
# and overlap each other's builds, and the dense kernels were no faster (docs/BENCHMARKS.md).
DENSE_HEAD_DIMS = (128,)


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


def use_tma(*tensors: torch.Tensor) -> bool:
    """The op's choice of TMA loads for these (B, H, T, D) tensors (``TMA_MIN_T``)."""
    return tensors[0].shape[2] >= TMA_MIN_T and tma_ok(*tensors)


def use_a_regs(q: torch.Tensor, tma: bool) -> bool:
    """The forward's ``A_REGS``: q read by the q k^T wgmma from registers, at the head dims of
    ``FWD_A_REGS_HEAD_DIMS``, with TMA loads, in 16-bit."""
    return tma and q.shape[-1] in FWD_A_REGS_HEAD_DIMS and q.dtype != torch.float32


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


# ---- launcher ----------------------------------------------------------------------------------

_TUNED: dict[tuple, Tuned] = {}
# The constexprs that select a kernel's code path: with the T bucket and head dim, its autotune key.
_KEY_LEVERS = ("TMA", "SIGMOID", "A_REGS", "CAUSAL", "HAS_KEY_BIAS", "HAS_GATE")


@functools.cache
def _dense():
    """The kernels of unpadded batches, imported at first use: that module takes the tile helpers
    above from this one."""
    return importlib.import_module("stabilitylab.kernels.sigmoid_attention_dense")


def pinned_config(configs: tuple[triton.Config, ...]) -> triton.Config:
    """The one config a kernel launches with under ``torch.use_deterministic_algorithms``: the
    smallest tile (BLOCK_M x BLOCK_N) of its list, the first of equals. Autotuning picks by timing,
    which varies from process to process, and configs of other tiles sum in another order: the
    kernels have no atomics, but two runs repeat bit for bit only on the same configs. The smallest
    tile is the one least likely to exceed shared memory at any head dim."""
    return min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])


def _launch(kernel, kind: str, q: torch.Tensor, grid, args: tuple, kwargs: dict, dense=False):
    """Launch ``kernel``: interpreted with one config, or autotuned per architecture, Triton
    specialisation of ``args`` and of the key bias (``specialization``) and key (T bucket, head
    dim, the path's constexprs, dtype), then launched straight with the config chosen; under
    ``torch.use_deterministic_algorithms`` with ``pinned_config``, untimed. ``dense``: a kernel
    that takes host-built descriptors, whose blocks each config sets."""
    if interpreting():
        if dense:
            _dense().set_blocks({**kwargs, **INTERPRETER_BLOCKS})
        interpreted(kernel)[grid](*args, **kwargs, **INTERPRETER_BLOCKS)
        return
    cap, fp32 = capability(q.device), q.dtype == torch.float32
    levers = [name for name in _KEY_LEVERS if name in kwargs]
    bias_spec = specialization(kwargs.get("KB"), kwargs.get("skbb"), kwargs.get("skbh"))
    pinned = torch.are_deterministic_algorithms_enabled()
    which = (kernel, cap, fp32, specialization(*args), bias_spec, pinned)
    tuned = _TUNED.get(which)
    if tuned is None:
        configs = _configs(kind, cap, fp32, dense)
        if pinned:
            configs = (pinned_config(configs),)
        tuned = _TUNED[which] = Tuned(kernel, configs, ["T_BUCKET", "HEAD_DIM", *levers])
    key = (seq_bucket(q.shape[2]), kwargs["HEAD_DIM"], *[kwargs[n] for n in levers], q.dtype)
    tuned.launch(grid, key, *args, **kwargs)


def _common_args(D: int, dtype: torch.dtype, log_bias: bool, sigmoid: int) -> dict:
    """Constexprs every kernel takes. Inline PTX cannot run in the interpreter: there the exact
    sigmoid, whatever was asked."""
    return {
        "HEAD_DIM": D,
        "LOG_BIAS": log_bias,
        "SIGMOID": EXACT if interpreting() else sigmoid,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _mask_and_bias_args(causal: bool, key_bias: torch.Tensor | None, gated: bool = False) -> dict:
    """The kernels' trailing arguments: CAUSAL, and the key bias (a (B, H, T) float32 tensor with
    unit stride along T, ``check_key_bias``) with its (b, h) strides when there is one;
    ``gated``: that tensor is the fused gate g, not a bias (HAS_GATE, passed only then, so that
    the kernels without it compile and autotune as before it existed)."""
    if key_bias is None:
        return {"CAUSAL": causal, "HAS_KEY_BIAS": False}
    sb, sh = key_bias.stride()[:2]
    out = {"CAUSAL": causal, "HAS_KEY_BIAS": True, "KB": key_bias, "skbb": sb, "skbh": sh}
    return {**out, "HAS_GATE": True} if gated else out


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


def _device_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch for the tensor descriptors the kernels build on the device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@functools.cache
def _unused_f32(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.float32, device=device)


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


def _forward(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, tma,
             causal=False, key_bias=None, gated=False):  # fmt: skip
    """The general forward on inputs with unit stride along D; ``tma`` already checked
    (``tma_ok``); ``gated``: ``key_bias`` holds the fused gate g."""
    B, H, T, D = q.shape
    if tma and not interpreting():
        triton.set_allocator(_device_allocator)
    out = _empty_bthd_as_bhtd(q)
    mx, n_mx = _max_buffer(q, return_max)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    args = _kernel_args((q, k, v, out), (mx,), lengths, H, T, n_mx, scale, bias)
    kwargs = {
        "RETURN_MAX": return_max,
        "TMA": tma,
        "A_REGS": use_a_regs(q, tma) and not interpreting(),
        **_common_args(D, q.dtype, log_bias, sigmoid),
        **_mask_and_bias_args(causal, key_bias, gated),
    }
    _launch(_sigmoid_fwd_kernel, "fwd", q, grid, args, kwargs)
    max_bh = mx.amax(dim=1).view(B, H) if return_max else mx.new_empty(0)
    return out, max_bh


def _forward_dense(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max,
                   causal=False, key_bias=None):  # fmt: skip
    """The forward of an unpadded batch: descriptors built here, once per call; persistent, at most
    one program per SM looping over query tiles, and no more programs than the same number of
    rounds needs (``persistent_grid``)."""
    dense = _dense()
    B, H, T, D = q.shape
    out = _empty_bthd_as_bhtd(q)
    mx, n_mx = _max_buffer(q, return_max)
    grid = lambda meta: (persistent_grid(cdiv(T, meta["BLOCK_M"]) * B * H, q.device),)
    args = (out, mx, lengths, *out.stride()[:3], H, T, seq_bucket(T), n_mx, scale, bias, B * H)
    kwargs = {
        "RETURN_MAX": return_max,
        "A_REGS": use_a_regs(q, True) and not interpreting(),
        **dense.descriptors(Q=q, K=k, V=v),
        **_common_args(D, q.dtype, log_bias, sigmoid),
        **_mask_and_bias_args(causal, key_bias),
    }
    _launch(dense._sigmoid_fwd_dense_kernel, "fwd", q, grid, args, kwargs, dense=True)
    max_bh = mx.amax(dim=1).view(B, H) if return_max else mx.new_empty(0)
    return out, max_bh


def _backward(do, q, k, v, lengths, scale, bias, log_bias, sigmoid, tma,
              causal=False, key_bias=None, dkb=None, gated=False):  # fmt: skip
    """The general dQ and dK/dV kernels: ``(dq, dk, dv)``, and the key bias's gradient per head
    written into ``dkb`` (a contiguous (B, H, T) float32 buffer) when there is a key bias (with
    ``gated``, the fused gate's). The dQ kernel is launched before dK and dV are even allocated:
    host time ahead of the first launch is GPU idle time."""
    B, H, T, D = q.shape
    if tma and not interpreting():
        triton.set_allocator(_device_allocator)
    dq = _empty_bthd_as_bhtd(q)
    kwargs = {
        "TMA": tma,
        **_common_args(D, q.dtype, log_bias, sigmoid),
        **_mask_and_bias_args(causal, key_bias, gated),
    }
    args = _kernel_args((q, k, v, do, dq), (), lengths, H, T, scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    _launch(_sigmoid_bwd_dq_kernel, "dq", q, grid, args, kwargs)
    dk, dv = _empty_bthd_as_bhtd(k), _empty_bthd_as_bhtd(v)
    args = _kernel_args((q, k, v, do, dk, dv), (), lengths, H, T, scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_N"]), B * H)
    dkb_arg = {} if key_bias is None else {"DKB": dkb}
    _launch(_sigmoid_bwd_dkdv_kernel, "dkdv", q, grid, args, {**kwargs, **dkb_arg})
    return dq, dk, dv


def _backward_dense(do, q, k, v, lengths, scale, bias, log_bias, sigmoid,
                    causal=False, key_bias=None, dkb=None):  # fmt: skip
    """The dQ and dK/dV kernels of an unpadded batch: ``(dq, dk, dv)``; ``dkb`` as ``_backward``."""
    dense = _dense()
    B, H, T, D = q.shape
    # The same descriptors for both: each launch sets the blocks its config's pre-hook asks for.
    kwargs = {
        **_common_args(D, q.dtype, log_bias, sigmoid),
        **dense.descriptors(Q=q, K=k, V=v, DO=do),
        **_mask_and_bias_args(causal, key_bias),
    }
    dq = _empty_bthd_as_bhtd(q)
    args = (dq, lengths, *dq.stride()[:3], H, T, seq_bucket(T), scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)
    _launch(dense._sigmoid_bwd_dq_dense_kernel, "dq", q, grid, args, kwargs, dense=True)
    dk, dv = _empty_bthd_as_bhtd(k), _empty_bthd_as_bhtd(v)
    args = (dk, dv, lengths, *dk.stride()[:3], *dv.stride()[:3], H, T, seq_bucket(T), scale, bias)
    grid = lambda meta: (cdiv(T, meta["BLOCK_N"]), B * H)
    dkb_arg = {} if key_bias is None else {"DKB": dkb}
    kernel = dense._sigmoid_bwd_dkdv_dense_kernel
    _launch(kernel, "dkdv", q, grid, args, {**kwargs, **dkb_arg}, dense=True)
    return dq, dk, dv


def forward_auto(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max,
                 causal=False, key_bias=None, gated=False):  # fmt: skip
    """The forward with the op's choices: an unpadded batch in the fast sigmoid mode to the dense
    kernel (``use_dense``), else the general kernel with TMA loads where ``use_tma``. The exact
    sigmoid keeps the general kernel: its persistent dense twin ran 7% slower. The fused gate
    (``gated``) runs in the general kernels only."""
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    tail = (causal, key_bias)
    if sigmoid != EXACT and not gated and use_dense(lengths, q, k, v):
        return _forward_dense(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, *tail)
    tma = use_tma(q, k, v)
    return _forward(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, tma, *tail, gated)


def backward_auto(do, q, k, v, lengths, scale, bias, log_bias, sigmoid,
                  causal=False, key_bias=None, gated=False):  # fmt: skip
    """The backward with the op's choices: an unpadded batch to the dense kernels (``use_dense``),
    else the general kernels with TMA loads where ``use_tma``. ``(dq, dk, dv, dkb)``, dkb the key
    bias's gradient per head, (B, H, T) float32, or None without a key bias; ``gated``: the fused
    gate's (in the general kernels only)."""
    do, q, k, v = (last_dim_contiguous(t) for t in (do, q, k, v))
    B, H, T, _ = q.shape
    dkb = None
    if key_bias is not None:
        dkb = torch.empty(B, H, T, dtype=torch.float32, device=q.device)  # every entry written
    tail = (causal, key_bias, dkb)
    if not gated and use_dense(lengths, q, k, v, do):
        grads = _backward_dense(do, q, k, v, lengths, scale, bias, log_bias, sigmoid, *tail)
    else:
        tma = use_tma(q, k, v, do)
        grads = _backward(do, q, k, v, lengths, scale, bias, log_bias, sigmoid, tma, *tail, gated)
    return (*grads, dkb)


# ---- torch.library ops (compile-friendly) + autograd --------------------------------------------
# ``custom_op``, not ``triton_op``: torch.compile sees each op as one opaque node (no graph break
# under fullgraph=True) and runs the body as in eager, with the real tensors' strides. Traced
# through as a ``triton_op``, inductor returned wrong values on the H200 (NaN, ~100x off) for
# reasons not pinned down (docs/LOG.md); an opaque op gives that up for certainty. ``key_bias``:
# the (B, H, T) float32 view of ``check_key_bias``; its gradient is per head; ``gated``: it is the
# fused gate g.


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
    causal: bool = False,
    key_bias: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The op runs under torch.compile, whose tracing skipped the lengths' range check.
    check_lengths_at_launch(lengths, q.shape[2])
    return forward_auto(
        q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, causal, key_bias, gated
    )


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
    causal: bool = False,
    key_bias: torch.Tensor | None = None,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv, dkb)``; dkb empty without a key bias (an op returns tensors only)."""
    check_lengths_at_launch(lengths, q.shape[2])  # as in the forward op
    dq, dk, dv, dkb = backward_auto(
        do, q, k, v, lengths, scale, bias, log_bias, sigmoid, causal, key_bias, gated
    )
    return dq, dk, dv, (q.new_empty(0, dtype=torch.float32) if dkb is None else dkb)


@_fwd_op.register_fake
def _fwd_fake(q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, causal=False,
              key_bias=None, gated=False):  # fmt: skip
    B, H = q.shape[:2]
    max_bh = q.new_empty((B, H) if return_max else (0,), dtype=torch.float32)
    return _empty_bthd_as_bhtd(q), max_bh


@_bwd_op.register_fake
def _bwd_fake(do, q, k, v, lengths, scale, bias, log_bias, sigmoid, causal=False, key_bias=None,
              gated=False):  # fmt: skip
    dkb = q.new_empty(q.shape[:3] if key_bias is not None else (0,), dtype=torch.float32)
    return (*(_empty_bthd_as_bhtd(t) for t in (q, k, v)), dkb)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, lengths, scale, bias, log_bias, sigmoid, _, causal, key_bias, gated = inputs
    ctx.save_for_backward(q, k, v, lengths, key_bias)
    ctx.args = (scale, bias, log_bias, sigmoid, causal)
    ctx.gated = gated


def _input_grads(dq, dk, dv, dkb, key_bias, n_inputs: int) -> tuple:
    """The gradients of the ops' inputs (q, k, v, then none for lengths and the numbers, then the
    key bias's (or the fused gate's), then none for ``gated``), for the ``n_inputs`` inputs a
    caller passed."""
    grads = (dq, dk, dv, None, None, None, None, None, None, None)
    return (*grads, None if key_bias is None else dkb, None)[:n_inputs]


def _backward_op(ctx, d_out, _d_max):
    q, k, v, lengths, key_bias = ctx.saved_tensors
    dq, dk, dv, dkb = _bwd_op(d_out, q, k, v, lengths, *ctx.args, key_bias, ctx.gated)
    return _input_grads(dq, dk, dv, dkb, key_bias, 12)


_fwd_op.register_autograd(_backward_op, setup_context=_setup_context)


class _EagerSigmoidAttention(torch.autograd.Function):
    """The same launches as the ops, for eager mode: a custom op's Python dispatch and autograd
    wrapper cost ~250 us of host time per call on the H200 host (docs/BENCHMARKS.md), which shows
    whenever a kernel is that short (T <= 1K, or heavy padding)."""

    @staticmethod
    def forward(ctx, q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, causal=False,
                key_bias=None, gated=False):  # fmt: skip
        out, max_bh = forward_auto(
            q, k, v, lengths, scale, bias, log_bias, sigmoid, return_max, causal, key_bias, gated
        )
        ctx.save_for_backward(q, k, v, lengths, key_bias)
        ctx.args = (scale, bias, log_bias, sigmoid, causal)
        ctx.gated = gated
        ctx.mark_non_differentiable(max_bh)
        return out, max_bh

    @staticmethod
    def backward(ctx, d_out, _d_max):
        q, k, v, lengths, key_bias = ctx.saved_tensors
        dq, dk, dv, dkb = backward_auto(d_out, q, k, v, lengths, *ctx.args, key_bias, ctx.gated)
        return _input_grads(dq, dk, dv, dkb, key_bias, len(ctx.needs_input_grad))


# ---- public function ---------------------------------------------------------------------------


def default_fast_mode(dtype: torch.dtype) -> int:
    """Sigmoid mode for ``exact=False``: the hardware tanh for 16-bit inputs, exact for float32
    (which asks for float32 accuracy). Near x = -log n the tanh's p carries up to ~1e-2 relative
    error and a small negative bias (experiments/bench/check_tanh.py; docs/BENCHMARKS.md): at
    T = 8K the kernel's row sums err 1.2e-3 (exact mode 9.9e-4, the fp16 output rounding); far
    longer contexts should take ``exact=True``."""
    return EXACT if dtype == torch.float32 else TANH_F32


def sigmoid_attention(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    scale: float | None = None,
    bias: float | None = None,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    key_bias_BHT: torch.Tensor | None = None,
    exact: bool = False,
    return_max_logit: bool = False,
    gate_BT: torch.Tensor | None = None,
    gate_BHT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out_BHTD, max_logit_BH | None)``; see the module docstring for formula and layout.

    ``causal``: query i sees keys j <= i. ``key_bias_BT`` (shared by the heads) or
    ``key_bias_BHT`` (one per head), at most one: added to every query's logit for key j, computed
    in float32, differentiable. ``exact=True`` evaluates ``1/(1+exp(-x))``; the default uses the
    hardware tanh on CUDA for bf16/fp16 inputs. The output is a (B, H, T, D) view of (B, T, H, D)
    memory.

    ``gate_BT`` / ``gate_BHT`` (opt-in; instead of a key bias): the KV-eviction gate g in [0, 1]
    fused into the kernels, ``out_i = sum_j sigmoid(s_ij + b + log(g_j + 1e-8)) g_j v_j`` with v
    as given, differentiable (its gradient computed in the dK/dV kernel): what the model computes
    with ``key_bias_BT=log(g + 1e-8)`` and ``g * v`` outside, in one op, no elementwise kernels
    around it. General kernels only (an unpadded head-dim-128 batch does not take the dense ones).
    """
    named = {"q_BHTD": q_BHTD, "k_BHTD": k_BHTD, "v_BHTD": v_BHTD}
    check_attention_inputs(named, lengths_B, scale, bias, causal)
    key_bias = check_key_bias(q_BHTD, key_bias_BT, key_bias_BHT)
    gate = check_key_bias(q_BHTD, gate_BT, gate_BHT, prefix="gate")
    if gate is not None and key_bias is not None:
        raise ValueError(
            "pass a gate (gate_BT / gate_BHT) or a key bias (key_bias_BT / key_bias_BHT), not "
            "both: the fused gate adds its own log(g + 1e-8)"
        )
    scale = 1.0 / math.sqrt(q_BHTD.shape[-1]) if scale is None else float(scale)
    mode = EXACT if exact else default_fast_mode(q_BHTD.dtype)
    bias_f = 0.0 if bias is None else float(bias)
    # Under torch.compile the opaque custom op (no graph break); in eager the cheaper Function.
    fn = _fwd_op if torch.compiler.is_compiling() else _EagerSigmoidAttention.apply
    tail = (key_bias,) if gate is None else (gate, True)  # the default call as before the gate
    out_BHTD, max_BH = fn(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, scale, bias_f, bias is None, mode, return_max_logit,
        causal, *tail,
    )  # fmt: skip
    return out_BHTD, (max_BH.detach() if return_max_logit else None)
