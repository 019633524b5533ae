"""Experimental forward of sigmoid attention with TMA tensor descriptors (and optional warp
specialisation): a lever for the head-dim-128 forward, which trails SDPA cuDNN by ~8%
(docs/BENCHMARKS.md). Forward only, not wired into the model; ``kernels/bench_attention.py``
times it as ``sigmoid-triton-tma`` / ``sigmoid-triton-tma-ws``. Not yet run on a GPU.

    out_BHTD = sigmoid(q k^T * scale + b) v   over valid keys; rows i >= L_b are 0

Same maths, layout and padding rules as ``sigmoid_attention.py`` (reference:
``kernels/reference.py::sigmoid_attention_reference``). What differs is how tiles arrive: one 2-D
descriptor per (batch, head) over the *valid* rows, shape (L_b, D) with row stride from the
tensor, so the hardware zero-fills rows past L_b. A zero key row adds sigmoid(b) * 0 to the
output because its value row is zero too: no masks in the loop.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.sigmoid_attention import EXACT, default_fast_mode
from stabilitylab.kernels.triton_support import (
    capability,
    check_attention_inputs,
    compiled,
    interpreted,
    interpreting,
    last_dim_contiguous,
    seq_bucket,
)


@triton.jit
def _sigmoid_fwd_tma_kernel(
    Q, K, V, Out, LENS,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
    H, T, T_BUCKET, scale, bias,
    HEAD_DIM: tl.constexpr, LOG_BIAS: tl.constexpr, SIGMOID: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_m = pid_m * BLOCK_M
    b64 = b.to(tl.int64)
    q_desc = tl.make_tensor_descriptor(
        Q + b64 * sqb + h * sqh, shape=[L, HEAD_DIM], strides=[sqt, 1],
        block_shape=[BLOCK_M, HEAD_DIM],
    )  # fmt: skip
    k_desc = tl.make_tensor_descriptor(
        K + b64 * skb + h * skh, shape=[L, HEAD_DIM], strides=[skt, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
    )  # fmt: skip
    v_desc = tl.make_tensor_descriptor(
        V + b64 * svb + h * svh, shape=[L, HEAD_DIM], strides=[svt, 1],
        block_shape=[BLOCK_N, HEAD_DIM],
    )  # fmt: skip
    q = q_desc.load([start_m, 0])
    bias_b = -tl.log(L.to(tl.float32)) if LOG_BIAS else bias
    if SIGMOID == 0:
        a_s = scale
        c_s = bias_b
    else:
        a_s = 0.5 * scale
        c_s = 0.5 * bias_b
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    hi = tl.where(start_m < L, L, 0)
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([start_n, 0])
        v = v_desc.load([start_n, 0])
        x = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * a_s + c_s
        if SIGMOID == 0:
            p = (1.0 / (1.0 + tl.exp(-x))).to(v.dtype)
        else:
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
            )
            p = (0.5 * t + 0.5).to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.where(offs_m[:, None] < L, acc, 0.0)
    tl.store(
        Out + b64 * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
        acc.to(Out.dtype.element_ty), mask=offs_m[:, None] < T,
    )  # fmt: skip


INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}
_TUNED: dict[tuple, object] = {}


def _configs(cap: tuple[int, int], fp32: bool) -> list[triton.Config]:
    """Candidates to measure; (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if fp32:
        blocks = [(64, 32, 4, 2)]
    elif cap[0] >= 9:
        blocks = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 2)]
    else:
        blocks = [(128, 64, 4, 2), (64, 64, 4, 2)]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in blocks
    ]


def _device_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    """Scratch for descriptors built on the device (Triton asks for it once per launch)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def sigmoid_attention_fwd_tma(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    scale: float | None = None,
    bias: float | None = None,
    exact: bool = False,
    warp_specialize: bool = False,
) -> torch.Tensor:
    """``out_BHTD`` (a fresh contiguous tensor); no autograd, no max|logit|. Inputs as for
    ``sigmoid_attention``; on top, every (b, h) base and row stride must be 16-byte aligned (TMA)."""
    named = {"q_BHTD": q_BHTD, "k_BHTD": k_BHTD, "v_BHTD": v_BHTD}
    check_attention_inputs(named, lengths_B, scale, bias)
    q, k, v = (last_dim_contiguous(t.detach()) for t in (q_BHTD, k_BHTD, v_BHTD))
    B, H, T, D = q.shape
    size = q.element_size()
    for name, t in (("q_BHTD", q), ("k_BHTD", k), ("v_BHTD", v)):
        if (t.data_ptr() % 16) or any((s * size) % 16 for s in t.stride()[:3]):
            raise ValueError(f"{name}: TMA needs 16-byte aligned base and (b, h, t) strides")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    fp32 = q.dtype == torch.float32
    if interpreting():
        launch, blocks, ws = interpreted(_sigmoid_fwd_tma_kernel), INTERPRETER_BLOCKS, False
    else:
        triton.set_allocator(_device_allocator)
        key = (capability(q.device), fp32, warp_specialize)  # tuned apart, to compare them
        if key not in _TUNED:
            _TUNED[key] = triton.autotune(configs=_configs(*key[:2]), key=["T_BUCKET", "HEAD_DIM"])(
                compiled(_sigmoid_fwd_tma_kernel)
            )
        launch, blocks, ws = _TUNED[key], {}, warp_specialize
    launch[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, out, lengths_B,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        H, T, seq_bucket(T), scale, 0.0 if bias is None else float(bias),
        HEAD_DIM=D, LOG_BIAS=bias is None,
        SIGMOID=EXACT if (exact or interpreting()) else default_fast_mode(q.dtype),
        DOT_PRECISION="ieee" if fp32 else "tf32", WARP_SPECIALIZE=ws, **blocks,
    )  # fmt: skip
    return out
