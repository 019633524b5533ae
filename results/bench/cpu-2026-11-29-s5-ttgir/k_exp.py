import triton
import triton.language as tl

@triton.jit
def _fwd_persist(Q, K, V, Out, LENS, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                 H, T, n_m, n_tiles, scale,
                 HEAD_DIM: tl.constexpr, TMA: tl.constexpr, FLATTEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    a_s = 0.5 * scale
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
        pid_bh = tile // n_m
        pid_m = tile - pid_bh * n_m
        b = pid_bh // H
        h = pid_bh - b * H
        L = tl.load(LENS + b).to(tl.int32)
        start_m = pid_m * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        b64 = b.to(tl.int64)
        q_base = Q + b64 * sqb + h * sqh
        k_base = K + b64 * skb + h * skh
        v_base = V + b64 * svb + h * svh
        c_s = -0.5 * tl.log(L.to(tl.float32))
        n_end = tl.where(start_m < L, L, 0)
        if TMA:
            q_desc = tl.make_tensor_descriptor(q_base, shape=[L, HEAD_DIM], strides=[sqt, 1], block_shape=[BLOCK_M, HEAD_DIM])
            k_desc = tl.make_tensor_descriptor(k_base, shape=[L, HEAD_DIM], strides=[skt, 1], block_shape=[BLOCK_N, HEAD_DIM])
            v_desc = tl.make_tensor_descriptor(v_base, shape=[L, HEAD_DIM], strides=[svt, 1], block_shape=[BLOCK_N, HEAD_DIM])
            q = q_desc.load([start_m, 0])
            k0 = k_desc.load([0, 0])
        else:
            q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :], mask=offs_m[:, None] < L, other=0.0)
            k0 = tl.load(k_base + offs_n[:, None] * skt + offs_d[None, :], mask=offs_n[:, None] < L, other=0.0)
        qk = tl.dot(q, tl.trans(k0))
        acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
        for start_n in range(0, n_end, BLOCK_N):
            n_k = start_n + BLOCK_N
            if TMA:
                k = k_desc.load([n_k, 0])
                v = v_desc.load([start_n, 0])
            else:
                rows_k = n_k + offs_n
                rows_v = start_n + offs_n
                k = tl.load(k_base + rows_k[:, None] * skt + offs_d[None, :], mask=rows_k[:, None] < L, other=0.0)
                v = tl.load(v_base + rows_v[:, None] * svt + offs_d[None, :], mask=rows_v[:, None] < L, other=0.0)
            qk_now = qk
            qk = tl.dot(q, tl.trans(k))
            x = qk_now * a_s + c_s
            t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)
            p = (0.5 * t + 0.5).to(v.dtype)
            acc = tl.dot(p, v, acc)
        acc = tl.where(offs_m[:, None] < L, acc, 0.0)
        tl.store(Out + b64 * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
                 acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T)
