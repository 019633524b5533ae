"""Session 8 experiment: the committed forward with Q_TILES consecutive query tiles per program,
the three tensor descriptors built once per program and reused for each of its tiles."""
import triton
import triton.language as tl


@triton.jit
def _fwd_group(
    Q, K, V, Out, MX, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    H, T, T_BUCKET, mx_stride, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
    LOOKAHEAD: tl.constexpr, A_REGS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    Q_TILES: tl.constexpr,
):  # fmt: skip
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
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    first_m = pid_g * (Q_TILES * BLOCK_M)
    if first_m < L:
        if TMA:
            q_desc = tl.make_tensor_descriptor(
                q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM]
            )
            k_desc = tl.make_tensor_descriptor(
                k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
            v_desc = tl.make_tensor_descriptor(
                v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM]
            )
        for g in range(Q_TILES):
            start_m = first_m + g * BLOCK_M
            offs_m = start_m + tl.arange(0, BLOCK_M)
            acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
            mx = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if start_m < L:
                if TMA:
                    q = q_desc.load([start_m, 0])
                else:
                    q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :],
                                mask=offs_m[:, None] < L, other=0.0)  # fmt: skip
                if A_REGS:
                    q = tl.inline_asm_elementwise(
                        "mov.b32 $0, $1;", "=r,r", [q], dtype=q.dtype, is_pure=True,
                        pack=32 // q.dtype.primitive_bitwidth,
                    )  # fmt: skip
                qk = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if LOOKAHEAD:
                    if TMA:
                        k0 = k_desc.load([0, 0])
                    else:
                        k0 = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :],
                                     mask=offs_n[:, None] < L, other=0.0)  # fmt: skip
                    qk = tl.dot(q, tl.trans(k0), input_precision=DOT_PRECISION)
                for start_n in range(0, L, BLOCK_N):
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
                            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
                        )
                        p = (0.5 * t + 0.5).to(v.dtype)
                    acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
            acc = tl.where(offs_m[:, None] < L, acc, 0.0)
            tl.store(o_base + offs_m[:, None] * sot + offs_d[None, :],
                     acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
            if RETURN_MAX:
                tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_g * Q_TILES + g,
                         tl.max(mx, axis=0) * scale)  # fmt: skip
    else:
        zero = tl.zeros((BLOCK_M, HEAD_DIM), dtype=Out.dtype.element_ty)
        for g in range(Q_TILES):
            offs_m = first_m + g * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(o_base + offs_m[:, None] * sot + offs_d[None, :], zero,
                     mask=offs_m[:, None] < T)  # fmt: skip
            if RETURN_MAX:
                tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_g * Q_TILES + g, 0.0)
