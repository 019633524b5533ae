"""Session 9 experiment: kernels for batches without padding (every L_b == T), with the TMA
descriptors built on the host (rank 4 over (B, H, T, D), the hardware zero-fills past T), so no
program builds descriptors and no length appears in a loop. Forward, dQ, dK/dV."""
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _fwd_dense(Qd, Kd, Vd, Out, MX, LENS, sob, soh, sot, H, T, T_BUCKET, mx_stride, scale, bias,
               HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
               RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, A_REGS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
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
    q = Qd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    if A_REGS:
        q = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [q], dtype=q.dtype, is_pure=True,
                                      pack=32 // q.dtype.primitive_bitwidth)
    k0 = Kd.load([b, h, 0, 0]).reshape(BLOCK_N, HEAD_DIM)
    qk = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    mx = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        k = Kd.load([b, h, start_n + BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = Vd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk_now = qk
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        if RETURN_MAX:
            mx = tl.maximum(mx, tl.max(tl.abs(qk_now), axis=1))
        x = qk_now * a_s + c_s
        if SIGMOID == 0:
            p = (1.0 / (1.0 + tl.exp(-x))).to(v.dtype)
        else:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
            p = (0.5 * t + 0.5).to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
    if RETURN_MAX:
        tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_m, tl.max(mx, axis=0) * scale)


@triton.jit
def _dq_dense(Qd, Kd, Vd, DOd, DQ, LENS, sdqb, sdqh, sdqt, H, T, T_BUCKET, scale, bias,
              HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
              DOT_PRECISION: tl.constexpr, A_REGS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
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
    q = Qd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    do = DOd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for start_n in range(0, T, BLOCK_N):
        k = Kd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = Vd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        x = s * a_s + c_s
        if SIGMOID == 0:
            p = 1.0 / (1.0 + tl.exp(-x))
            ds = (p - p * p) * dp
        else:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                          is_pure=True, pack=1)
            ds = (1.0 - t * t) * dp
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    ds_scale = scale if SIGMOID == 0 else 0.25 * scale
    tl.store(DQ + b.to(tl.int64) * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
             (dq * ds_scale).to(DQ.dtype.element_ty), mask=offs_m[:, None] < T)


@triton.jit
def _dkdv_dense(Qd, Kd, Vd, DOd, DK, DV, LENS, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, T, T_BUCKET,
                scale, bias, HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
                DOT_PRECISION: tl.constexpr, A_REGS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
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
    k = Kd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    v = Vd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for start_m in range(0, T, BLOCK_M):
        q = Qd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        do = DOd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        x_t = s_t * a_s + c_s
        if SIGMOID == 0:
            p_t = 1.0 / (1.0 + tl.exp(-x_t))
            ds_t = (p_t - p_t * p_t) * dp_t
        else:
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x_t], dtype=tl.float32,
                                          is_pure=True, pack=1)
            p_t = 0.5 * t + 0.5
            ds_t = (1.0 - t * t) * dp_t
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    ds_scale = scale if SIGMOID == 0 else 0.25 * scale
    in_range = offs_n[:, None] < T
    tl.store(DK + b.to(tl.int64) * sdkb + h * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
             (dk * ds_scale).to(DK.dtype.element_ty), mask=in_range)
    tl.store(DV + b.to(tl.int64) * sdvb + h * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=in_range)


def desc(t, blk):
    D = t.shape[-1]
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, blk, D])


def _hook_fwd(nargs):
    D = nargs["HEAD_DIM"]
    nargs["Qd"].block_shape = [1, 1, nargs["BLOCK_M"], D]
    nargs["Kd"].block_shape = [1, 1, nargs["BLOCK_N"], D]
    nargs["Vd"].block_shape = [1, 1, nargs["BLOCK_N"], D]


def _hook_bwd(nargs):
    D = nargs["HEAD_DIM"]
    nargs["Qd"].block_shape = [1, 1, nargs["BLOCK_M"], D]
    nargs["DOd"].block_shape = [1, 1, nargs["BLOCK_M"], D]
    nargs["Kd"].block_shape = [1, 1, nargs["BLOCK_N"], D]
    nargs["Vd"].block_shape = [1, 1, nargs["BLOCK_N"], D]


def cfgs(lst, hook):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s, pre_hook=hook)
            for m, n, w, s in lst]


@triton.jit
def _fwd_dense_ws(Qd, Kd, Vd, Out, MX, LENS, sob, soh, sot, H, T, T_BUCKET, mx_stride, scale, bias,
                  HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
                  RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, A_REGS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """No look-ahead; the key loop warp-specialised by the compiler."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    a_s = 0.5 * scale
    c_s = 0.5 * bias_b
    q = Qd.load([b, h, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for start_n in tl.range(0, T, BLOCK_N, warp_specialize=True):
        k = Kd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = Vd.load([b, h, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        x = qk * a_s + c_s
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                      is_pure=True, pack=1)
        p = (0.5 * t + 0.5).to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
             acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
