"""Sigmoid attention kernels for batches without padding (every L_b == T): forward, dQ, dK/dV.

The maths, layout and tile helpers are those of ``kernels/sigmoid_attention.py``, which launches
these kernels. With no sequence padded, every tile is read through a rank-4 tensor descriptor over
the whole (B, H, T, D) tensor, built once on the host (the model's packed qkv views qualify): the
hardware zero-fills rows past T, so no program builds a descriptor, no loop tests a length and no
output row needs zeroing. The general kernels build three descriptors per program, a fixed cost
that shows where programs are short (T <= 4K at head dim 128). Results equal theirs bit for bit.

The forward is persistent: at most one program per SM takes query tiles round-robin, so none is
launched per tile (``persistent_grid`` sizes the grid). Each kernel takes the descriptors ``*_d``
(built by ``descriptors`` with a placeholder block that ``set_blocks``, the configs' pre-hook, sets
to the config's tile) and LENS only for the default bias -log(L_b), read exactly as the general
kernels read it, so both paths agree bit for bit. Causal masking and the key bias: as there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from stabilitylab.kernels.sigmoid_attention import (
    HOST_TMA,
    causal_key_split,
    causal_query_split,
    dkdv_query_tiles,
    dq_key_tiles,
    ds_scale,
    fwd_key_tiles,
    in_registers,
    key_affine,
    score_affine,
    tile_order,
)
from stabilitylab.kernels.triton_support import bits_as_max

# Which block of its config each descriptor argument carries (rows per tile; the last dim is D).
DESC_BLOCKS = {"Q_d": "BLOCK_M", "DO_d": "BLOCK_M", "K_d": "BLOCK_N", "V_d": "BLOCK_N"}


def descriptors(**tensors_BHTD: torch.Tensor) -> dict[str, TensorDescriptor]:
    """``{name}_d`` -> a rank-4 descriptor over each (B, H, T, D) tensor, its block one row of one
    head until ``set_blocks`` gives it the launch config's tile."""
    return {
        f"{name}_d": TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, t.shape[3]])
        for name, t in tensors_BHTD.items()
    }


def set_blocks(nargs: dict) -> None:
    """Config pre-hook: each descriptor's block becomes one tile of the config (BLOCK_M query
    rows for q and dO, BLOCK_N key rows for k and v)."""
    for name, block in DESC_BLOCKS.items():
        desc = nargs.get(name)
        if desc is not None:
            desc.block_shape = [1, 1, nargs[block], desc.block_shape[3]]


@triton.jit
def _sigmoid_fwd_dense_kernel(
    Out, MX, LENS, sob, soh, sot, H, T, T_BUCKET, mx_stride, scale, bias, BH,
    Q_d, K_d, V_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, A_REGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    # Persistent: each program takes query tiles round-robin, tile = pid_bh * n_m + pid_m, so the
    # programs in flight share a few heads' keys in L2.
    n_m = tl.cdiv(T, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_m * BH, tl.num_programs(0)):
        pid_bh = tile // n_m
        pid_m = tile_order(tile - pid_bh * n_m, n_m, CAUSAL)
        b = pid_bh // H
        h = pid_bh % H
        L = tl.load(LENS + b).to(tl.int32)  # == T; read for the bias only
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        kb_base = KB + b.to(tl.int64) * skbb + h * skbh if HAS_KEY_BIAS else KB
        a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
        q = Q_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        if A_REGS:
            q = in_registers(q)
        k0 = K_d.load([b, h, 0, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        mx_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
        # As in the general forward, with T for L: past T the descriptor reads zeros, the last
        # key tile hides its keys past T, rows past T stay out of the max and are not stored (the
        # last look-ahead's scores are discarded).
        if CAUSAL:
            diag, end = causal_key_split(start_m, T, BLOCK_M, BLOCK_N)
        else:
            diag, end = T // BLOCK_N * BLOCK_N, T
        acc, mx_bits, qk = fwd_key_tiles(
            acc, mx_bits, qk, q, K_d, V_d, kb_base, b, h, 0, diag, offs_m, offs_n, offs_d, 0, 0,
            T, a_s, c_s, False, HAS_KEY_BIAS, SIGMOID, RETURN_MAX, DOT_PRECISION, HOST_TMA,
            BLOCK_N,
        )  # fmt: skip
        acc, mx_bits, qk = fwd_key_tiles(
            acc, mx_bits, qk, q, K_d, V_d, kb_base, b, h, diag, end, offs_m, offs_n, offs_d,
            0, 0, T, a_s, c_s, CAUSAL, HAS_KEY_BIAS, SIGMOID, RETURN_MAX, DOT_PRECISION,
            HOST_TMA, BLOCK_N, not CAUSAL,
        )  # fmt: skip
        tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
        if RETURN_MAX:
            mx_bits = tl.where(offs_m < T, mx_bits, 0)
            tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_m, bits_as_max(mx_bits) * scale)


@triton.jit
def _sigmoid_bwd_dq_dense_kernel(
    DQ, LENS, sdqb, sdqh, sdqt, H, T, T_BUCKET, scale, bias,
    Q_d, K_d, V_d, DO_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    pid_m = tile_order(tl.program_id(0), tl.num_programs(0), CAUSAL)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)  # == T; read for the bias only
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kb_base = KB + b.to(tl.int64) * skbb + h * skbh if HAS_KEY_BIAS else KB
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    q = Q_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = DO_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    if CAUSAL:  # keys past T: v = 0, so dS = 0
        diag, end = causal_key_split(start_m, T, BLOCK_M, BLOCK_N)
    else:
        diag = T
    dq = dq_key_tiles(
        dq, q, do, K_d, V_d, kb_base, b, h, 0, diag, offs_m, offs_n, offs_d, 0, 0, T, a_s, c_s,
        False, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, HOST_TMA, BLOCK_N,
    )  # fmt: skip
    if CAUSAL:
        dq = dq_key_tiles(
            dq, q, do, K_d, V_d, kb_base, b, h, diag, end, offs_m, offs_n, offs_d, 0, 0, T, a_s,
            c_s, True, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, HOST_TMA, BLOCK_N,
        )  # fmt: skip
    dq_scale = ds_scale(scale, SIGMOID)
    tl.store(DQ + b.to(tl.int64) * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
             (dq * dq_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip


@triton.jit
def _sigmoid_bwd_dkdv_dense_kernel(
    DK, DV, LENS, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, T, T_BUCKET, scale, bias,
    Q_d, K_d, V_d, DO_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KB=None, skbb=None, skbh=None, DKB=None,
    CAUSAL: tl.constexpr = False, HAS_KEY_BIAS: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)  # == T; read for the bias only
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kb_base = KB + b.to(tl.int64) * skbb + h * skbh if HAS_KEY_BIAS else KB
    a_s, c_s = score_affine(L, scale, bias, LOG_BIAS, SIGMOID)
    k = K_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = V_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    c = key_affine(c_s, kb_base, offs_n[:, None], T, HAS_KEY_BIAS, SIGMOID)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Queries past T have dO = 0 and add nothing.
    if CAUSAL:
        lo, diag_end = causal_query_split(start_n, T, BLOCK_M, BLOCK_N)
        dk, dv, dkb = dkdv_query_tiles(
            dk, dv, dkb, k, v, Q_d, DO_d, b, h, lo, diag_end, offs_n, offs_m, offs_d, 0, 0, T,
            a_s, c, True, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, HOST_TMA, BLOCK_M,
        )  # fmt: skip
    else:
        diag_end = 0
    dk, dv, dkb = dkdv_query_tiles(
        dk, dv, dkb, k, v, Q_d, DO_d, b, h, diag_end, T, offs_n, offs_m, offs_d, 0, 0, T, a_s, c,
        False, HAS_KEY_BIAS, SIGMOID, DOT_PRECISION, HOST_TMA, BLOCK_M,
    )  # fmt: skip
    dk_scale = ds_scale(scale, SIGMOID)
    in_range = offs_n[:, None] < T
    b64 = b.to(tl.int64)
    tl.store(DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
             (dk * dk_scale).to(DK.dtype.element_ty), mask=in_range)  # fmt: skip
    tl.store(DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=in_range)  # fmt: skip
    if HAS_KEY_BIAS:
        dkb_base = DKB + pid_bh.to(tl.int64) * T
        tl.store(dkb_base + offs_n, dkb * ds_scale(1.0, SIGMOID), mask=offs_n < T)
