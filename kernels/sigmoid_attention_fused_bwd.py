"""Sigmoid attention backward in one kernel: dK, dV and dQ over key tiles, dQ reduced in float32.

The split backward of ``kernels/sigmoid_attention.py`` runs a dQ kernel over query tiles and a
dK/dV kernel over key tiles: no atomics, but S, dP and the sigmoid are computed twice, 7 matrix
products per tile pair. Here each key-tile program also forms its share of dQ,
``dq_part = dS^T' K`` (the transposed tile it already holds), and adds it into a float32 (B, T, H, D)
buffer: 5 products and one sigmoid per pair. On sm90 the add is a TMA reduce (one bulk
``cp.reduce.async`` per tile, issued from shared memory); in Triton's interpreter, which has no
descriptor reduce, pointer atomics. A last elementwise pass scales the buffer and rounds it to the
input dtype.

Atomics sum in whatever order the programs arrive: dQ is not bit-for-bit reproducible, so the op
keeps the split kernels under ``torch.use_deterministic_algorithms``. ``STAGGER``: each program
starts its query loop at its own tile (key tile index modulo the query tiles), so the programs of
one head do not all add into the same dQ rows at once (non-causal only; the causal loop keeps the
split kernel's order). The maths, masks and key bias are the split kernels'; the tile helpers are
theirs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.sigmoid_attention import (
    _device_allocator,
    _empty_bthd_as_bhtd,
    causal_query_split,
    key_affine,
    load_rows,
    p_and_ds,
    score_affine,
    store_dkdv,
)
from stabilitylab.kernels.triton_support import cdiv, interpreting


@triton.jit
def reduce_dq(dq_dst, dq_base, start_m, queries, offs_d, sdqt, L, dq_part,
              REDUCE_TMA: tl.constexpr):  # fmt: skip
    """``dQ[start_m : start_m + BLOCK_M] += dq_part`` in float32: a TMA reduce through the
    descriptor ``dq_dst`` (rows past L dropped by the hardware) or masked pointer atomics."""
    if REDUCE_TMA:
        dq_dst.atomic_add([start_m, 0], dq_part)
    else:
        ptrs = dq_base + queries[:, None] * sdqt + offs_d[None, :]
        tl.atomic_add(ptrs, dq_part, mask=queries[:, None] < L, sem="relaxed")


@triton.jit
def fused_query_tile(
    dk, dv, dkb, k, v, q_src, do_src, dq_dst, dq_base, start_m, offs_n, offs_m, offs_d, sdqt, L,
    a_s, c,
    MASK: tl.constexpr, HAS_KEY_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REDUCE_TMA: tl.constexpr,
):  # fmt: skip
    """One query tile of a key-tile program: ``dv += P^T dO``, ``dk += dS^T Q``, the key bias's
    row sums, and ``dQ += dS K`` for these queries (unscaled, as in the split kernels)."""
    queries = start_m + offs_m
    q = q_src.load([start_m, 0])
    do = do_src.load([start_m, 0])
    p_t, ds_t = p_and_ds(
        k, q, v, do, a_s, c, queries[None, :], offs_n[:, None], MASK, SIGMOID, DOT_PRECISION
    )
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    ds_t16 = ds_t.to(q.dtype)
    dk = tl.dot(ds_t16, q, dk, input_precision=DOT_PRECISION)
    if HAS_KEY_BIAS:
        dkb += tl.sum(ds_t, axis=1)
    dq_part = tl.dot(tl.trans(ds_t16), k, input_precision=DOT_PRECISION)
    reduce_dq(dq_dst, dq_base, start_m, queries, offs_d, sdqt, L, dq_part, REDUCE_TMA)
    return dk, dv, dkb


@triton.jit
def _sigmoid_bwd_fused_kernel(
    Q, K, V, DO, DK, DV, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdob, sdoh, sdot,
    sdkb, sdkh, sdkt, sdvb, sdvh, sdvt,
    H, T, T_BUCKET, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, REDUCE_TMA: tl.constexpr, STAGGER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DQ32=None, sdqb=0, sdqh=0, sdqt=0,
    KB=None, skbb=None, skbh=None, DKB=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    """One program per (key tile, b * h); ``DQ32`` a zeroed float32 buffer (a keyword argument,
    so that the configs' pre-hook, ``zero_dq``, sees it), ``DKB`` as the split dK/dV kernel's. q and dO are read through per-head descriptors over the L_b valid rows."""
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
    dq_base = DQ32 + b64 * sdqb + h * sdqh
    k_base = K + b64 * skb + h * skh
    v_base = V + b64 * svb + h * svh
    kb_base = KB + b64 * skbb + h * skbh if HAS_KEY_BIAS else KB
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if start_n < L:
        q_src = tl.make_tensor_descriptor(
            q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
        )
        do_src = tl.make_tensor_descriptor(
            do_base, shape=[L, HEAD_DIM], strides=[sdot, 1], block_shape=[BLOCK_M, HEAD_DIM]
        )
        dq_dst = dq_base
        if REDUCE_TMA:
            dq_dst = tl.make_tensor_descriptor(
                dq_base, shape=[L, HEAD_DIM], strides=[sdqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
        k = load_rows(k_base, offs_n, skt, L, offs_d)
        v = load_rows(v_base, offs_n, svt, L, offs_d)
        c = key_affine(c_s, kb_base, offs_n[:, None], L, HAS_KEY_BIAS, SIGMOID)
        if CAUSAL:
            lo, diag_end = causal_query_split(start_n, L, BLOCK_M, BLOCK_N)
            for start_m in range(lo, diag_end, BLOCK_M):
                dk, dv, dkb = fused_query_tile(
                    dk, dv, dkb, k, v, q_src, do_src, dq_dst, dq_base, start_m, offs_n, offs_m,
                    offs_d, sdqt, L, a_s, c, True, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, REDUCE_TMA,
                )  # fmt: skip
            for start_m in range(diag_end, L, BLOCK_M):
                dk, dv, dkb = fused_query_tile(
                    dk, dv, dkb, k, v, q_src, do_src, dq_dst, dq_base, start_m, offs_n, offs_m,
                    offs_d, sdqt, L, a_s, c, False, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION,
                    REDUCE_TMA,
                )  # fmt: skip
        else:
            n_m = tl.cdiv(L, BLOCK_M)
            for j in range(0, n_m):
                start_m = ((j + pid_n) % n_m if STAGGER else j) * BLOCK_M
                dk, dv, dkb = fused_query_tile(
                    dk, dv, dkb, k, v, q_src, do_src, dq_dst, dq_base, start_m, offs_n, offs_m,
                    offs_d, sdqt, L, a_s, c, False, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION,
                    REDUCE_TMA,
                )  # fmt: skip
    store_dkdv(
        DK + b64 * sdkb + h * sdkh, DV + b64 * sdvb + h * sdvh, DKB, dk, dv, dkb, offs_n, offs_d,
        sdkt, sdvt, pid_bh, L, T, scale, SIGMOID, HAS_KEY_BIAS,
    )  # fmt: skip


def zero_dq(nargs: dict) -> None:
    """The fused configs' pre-hook: the dQ accumulator zeroed before every launch, the autotuner's
    timing runs included (each would add into the last one's sums)."""
    nargs["DQ32"].zero_()


def dq_buffer_BHTD(q: torch.Tensor) -> torch.Tensor:
    """The float32 dQ accumulator: a (B, H, T, D) view of (B, T, H, D) memory, so the rounded dQ
    comes out in the layout of the split kernel's. Zeroed here in the interpreter (one launch, no
    configs); on the GPU by ``zero_dq``."""
    B, H, T, D = q.shape
    alloc = torch.zeros if interpreting() else torch.empty
    return alloc(B, T, H, D, dtype=torch.float32, device=q.device).permute(0, 2, 1, 3)


def backward_fused(launch, do, q, k, v, lengths, scale, args_tail: tuple, kwargs: dict,
                   dkb=None):  # fmt: skip
    """``(dq, dk, dv)`` from the fused kernel, launched through ``launch`` (the op's
    ``_launch``); ``args_tail`` the kernels' ``(H, T, T_BUCKET, scale, bias)``, ``kwargs`` their
    constexprs and key-bias arguments, ``dkb`` the key bias's gradient buffer."""
    B, H, T, D = q.shape
    if not interpreting():
        triton.set_allocator(_device_allocator)
    dq32 = dq_buffer_BHTD(q)
    dk, dv = _empty_bthd_as_bhtd(k), _empty_bthd_as_bhtd(v)
    strided = (q, k, v, do, dk, dv)
    strides = [st for t in strided for st in t.stride()[:3]]
    args = (*strided, lengths, *strides, *args_tail)
    sdqb, sdqh, sdqt = dq32.stride()[:3]
    fused = {
        **{name: value for name, value in kwargs.items() if name != "TMA"},  # always TMA loads
        "REDUCE_TMA": not interpreting(),
        "STAGGER": True,
        "DQ32": dq32, "sdqb": sdqb, "sdqh": sdqh, "sdqt": sdqt,
        **({} if dkb is None else {"DKB": dkb}),
    }  # fmt: skip
    grid = lambda meta: (cdiv(T, meta["BLOCK_N"]), B * H)  # noqa: E731
    launch(_sigmoid_bwd_fused_kernel, "fused", q, grid, args, fused)
    dq = dq32.mul_(scale if kwargs["SIGMOID"] == 0 else 0.25 * scale).to(q.dtype)
    return dq, dk, dv
