"""Sigmoid attention kernels for batches without padding (every L_b == T): forward, dQ, dK/dV.

The same maths as ``kernels/sigmoid_attention.py`` (whose docstring gives it, with the backward's
formulas; the reference is ``kernels/reference.py::sigmoid_attention_reference``), for the case
where no sequence is padded. Then every tile is read through a tensor descriptor built once on
the host, rank 4 over the whole (B, H, T, D) tensor with its strides (the model's packed qkv views
qualify): the hardware zero-fills the rows past T, so no program builds a descriptor, no loop
tests a length and no output row needs zeroing. The general kernels build three descriptors per
program over its sequence's L_b valid rows, about 5,000 of the ~8,800 cycles an hd-128 forward
program spends before its key loop at T = 4K (session 8's clock probes). Measured on the H200
(session 9, docs/BENCHMARKS.md): the same outputs bit for bit, and time saved where a program is
short (T <= 4K); see there for the numbers.

The forward is persistent: at most one program per SM takes query tiles round-robin, so no
program is launched per tile (session 10: +2% to +6% over one program per tile at hd 128, T = 16K
to 4K); as few programs as need no more rounds (``persistent_grid``: 128 on 132 SMs for 2,048
tiles, session 11: +2% to +3%). The op sends only the fast sigmoid mode here; persistent, the exact
mode's forward was 7% slower than the general kernel's.

Each kernel takes the descriptors ``*_d`` (built by ``descriptors`` with a placeholder block that
``set_blocks``, the configs' pre-hook, sets to the config's tile) and LENS only for the default
bias ``-log(L_b)``, read exactly as the general kernels read it, so both paths agree bit for bit.
Levers: the forward always issues the next key tile's scores ahead (``LOOKAHEAD`` of the general
kernel) and takes ``A_REGS``; the backward kernels issue dP before the sigmoid, no look-ahead (the
general kernels' production choice, ``BWD_LEVERS``). The sigmoid is spelled out in each kernel:
the interpreter twin of a kernel cannot call a compiled helper.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

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
):  # fmt: skip
    # Persistent: each program takes query tiles round-robin, tile = pid_bh * n_m + pid_m, so the
    # programs in flight share a few heads' keys in L2, and no program is launched per tile.
    n_m = tl.cdiv(T, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_m * BH, tl.num_programs(0)):
        pid_bh = tile // n_m
        pid_m = tile - pid_bh * n_m
        b = pid_bh // H
        h = pid_bh % H
        L = tl.load(LENS + b).to(tl.int32)  # == T; read for the bias only
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
        if SIGMOID == 0:
            a_s = scale
            c_s = bias_b
        else:  # tanh(x/2): the 1/2 folded into the per-score multiply-add
            a_s = 0.5 * scale
            c_s = 0.5 * bias_b
        q = Q_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        if A_REGS:  # q through an opaque move: the q k^T wgmma reads q from registers
            q = tl.inline_asm_elementwise(
                "mov.b32 $0, $1;", "=r,r", [q], dtype=q.dtype, is_pure=True,
                pack=32 // q.dtype.primitive_bitwidth,
            )  # fmt: skip
        k0 = K_d.load([b, h, 0, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        mx = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for start_n in range(0, T, BLOCK_N):
            # The scores of key tile j+1 are issued before the sigmoid of tile j; past T the
            # descriptor reads zeros (and the last look-ahead's scores are discarded).
            k = K_d.load([b, h, start_n + BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
            v = V_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
            qk_now = qk
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if RETURN_MAX:  # rows and keys past T score 0: they never raise the max
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
            acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)  # keys past T: v = 0
        tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
        if RETURN_MAX:
            tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_m, tl.max(mx, axis=0) * scale)


@triton.jit
def _sigmoid_bwd_dq_dense_kernel(
    DQ, LENS, sdqb, sdqh, sdqt, H, T, T_BUCKET, scale, bias,
    Q_d, K_d, V_d, DO_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)  # == T; read for the bias only
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    q = Q_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = DO_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        k = K_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = V_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        # dP first (it needs no P): its wgmma runs while the MUFU evaluates the sigmoid. Keys
        # past T have v = 0, hence dP = 0 and dS = 0.
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        x = s * a_s + c_s
        if SIGMOID == 0:
            p = 1.0 / (1.0 + tl.exp(-x))
            ds = (p - p * p) * dp  # p (1 - p) dp
        else:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
            )
            ds = (1.0 - t * t) * dp  # p (1 - p) = (1 - t^2) / 4; the 1/4 is in ds_scale
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    ds_scale = scale if SIGMOID == 0 else 0.25 * scale
    tl.store(DQ + b.to(tl.int64) * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
             (dq * ds_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip


@triton.jit
def _sigmoid_bwd_dkdv_dense_kernel(
    DK, DV, LENS, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, T, T_BUCKET, scale, bias,
    Q_d, K_d, V_d, DO_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)  # == T; read for the bias only
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    k = K_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = V_d.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    # Transposed scores (keys x queries) so that P^T and dS^T feed the dots without a transpose.
    for start_m in range(0, T, BLOCK_M):
        q = Q_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = DO_d.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        x_t = s_t * a_s + c_s
        if SIGMOID == 0:
            p_t = 1.0 / (1.0 + tl.exp(-x_t))
            ds_t = (p_t - p_t * p_t) * dp_t
        else:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [x_t], dtype=tl.float32, is_pure=True, pack=1
            )
            p_t = 0.5 * t + 0.5
            ds_t = (1.0 - t * t) * dp_t  # 4 p (1 - p) dP^T; the 1/4 is in ds_scale
        # Queries past T have dO = 0: their columns add nothing to dV or dS^T.
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    ds_scale = scale if SIGMOID == 0 else 0.25 * scale
    in_range = offs_n[:, None] < T
    b64 = b.to(tl.int64)
    tl.store(DK + b64 * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
             (dk * ds_scale).to(DK.dtype.element_ty), mask=in_range)  # fmt: skip
    tl.store(DV + b64 * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=in_range)  # fmt: skip
