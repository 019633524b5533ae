import triton
import triton.language as tl

@triton.jit
def _dq_persist(
    DQ, LENS, sdqb, sdqh, sdqt, H, T, T_BUCKET, scale, bias, N_T, N_UNITS,
    Q_d, K_d, V_d, DO_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for unit in tl.range(tl.program_id(0), N_UNITS, tl.num_programs(0)):
        pid_bh = unit // N_T
        pid_m = unit - pid_bh * N_T
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
def _dkdv_persist(
    DK, DV, LENS, sdkb, sdkh, sdkt, sdvb, sdvh, sdvt, H, T, T_BUCKET, scale, bias, N_T, N_UNITS,
    Q_d, K_d, V_d, DO_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for unit in tl.range(tl.program_id(0), N_UNITS, tl.num_programs(0)):
        pid_bh = unit // N_T
        pid_n = unit - pid_bh * N_T
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

