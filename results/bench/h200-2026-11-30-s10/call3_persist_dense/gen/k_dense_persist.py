import triton
import triton.language as tl

@triton.jit
def _fwd_dense_persist(
    Out, MX, LENS, sob, soh, sot, H, T, T_BUCKET, mx_stride, scale, bias, N_M, N_TILES,
    Q_d, K_d, V_d,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    RETURN_MAX: tl.constexpr, DOT_PRECISION: tl.constexpr, A_REGS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    for tile in tl.range(tl.program_id(0), N_TILES, tl.num_programs(0)):
        pid_bh = tile // N_M
        pid_m = tile - pid_bh * N_M
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
                    "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
                )
                p = (0.5 * t + 0.5).to(v.dtype)
            acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)  # keys past T: v = 0
        tl.store(Out + b.to(tl.int64) * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)  # fmt: skip
        if RETURN_MAX:
            tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_m, tl.max(mx, axis=0) * scale)

