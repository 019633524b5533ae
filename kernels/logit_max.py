"""Stats-only Triton reduction: ``max_BH = max over valid (i, j) of |q_i . k_j| * scale``.

Under ``causal=True`` only pairs with j <= i count; key tiles above the diagonal are skipped.

For the softmax arm, whose fused kernel (SDPA) cannot report its logits: Q K^T tiles only, no V,
no n x n tensor. Same layout and padding rules as ``sigmoid_attention`` (padded rows are loaded as
zeros and their pairs count as |0|, so they never win the max); each program writes its tile's maximum and a
tiny ``amax`` finishes, so no atomics. A NaN score makes its head's maximum NaN, as in the
reference ``kernels/reference.py::max_abs_logit_reference``.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from stabilitylab.kernels.reference import max_abs_logit_reference  # noqa: F401  (the maths)
from stabilitylab.kernels.triton_support import (
    bits_as_max,
    capability,
    cdiv,
    check_attention_inputs,
    check_lengths_at_launch,
    compiled,
    interpreted,
    interpreting,
    last_dim_contiguous,
    max_abs_bits,
    seq_bucket,
    specialization,
)


@triton.jit
def _max_over_keys(
    mx_bits, q, k_base, lo, hi, offs_m, offs_n, skt, L,
    MASK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key tiles [lo, hi) into the running row max; ``MASK``: a causal tile on the diagonal, whose
    hidden pairs (key > query) count as |0|. Pairs with a padded row count as |0| too: padding
    reads as zeros, and q . 0 is NaN for a q holding an inf (a cheap select: this kernel only
    reduces)."""
    for start_n in range(lo, hi, BLOCK_N):
        rows_n = start_n + offs_n
        k = tl.load(k_base + rows_n[:, None] * skt, mask=rows_n[:, None] < L, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        visible = (rows_n[None, :] < L) & (offs_m[:, None] < L)
        if MASK:
            visible = visible & (rows_n[None, :] <= offs_m[:, None])
        mx_bits = max_abs_bits(mx_bits, tl.where(visible, qk, 0.0))
    return mx_bits


@triton.jit
def _max_abs_logit_kernel(
    Q, K, MX, LENS,
    sqb, sqh, sqt, skb, skh, skt,
    H, T, T_BUCKET, mx_stride, scale,
    HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr = False,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    L = tl.load(LENS + b).to(tl.int32)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    b64 = b.to(tl.int64)
    q = tl.load(
        Q + b64 * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
        mask=offs_m[:, None] < L, other=0.0,
    )  # fmt: skip
    k_base = K + b64 * skb + h * skh + offs_d[None, :]
    mx_bits = tl.zeros((BLOCK_M,), dtype=tl.int32)
    hi = tl.where(start_m < L, L, 0)
    if CAUSAL:  # below the diagonal unmasked, across it masked, above it never visited
        diag = tl.minimum(start_m // BLOCK_N * BLOCK_N, hi)
        end = tl.minimum(start_m + BLOCK_M, hi)
    else:
        diag = hi
    mx_bits = _max_over_keys(
        mx_bits, q, k_base, 0, diag, offs_m, offs_n, skt, L, False, DOT_PRECISION, BLOCK_N
    )
    if CAUSAL:
        mx_bits = _max_over_keys(
            mx_bits, q, k_base, diag, end, offs_m, offs_n, skt, L, True, DOT_PRECISION, BLOCK_N
        )
    tl.store(MX + pid_bh.to(tl.int64) * mx_stride + pid_m, bits_as_max(mx_bits) * scale)


INTERPRETER_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}


@functools.cache  # called on every launch (the buffer size): build the list once
def _configs(cap: tuple[int, int], fp32: bool = False) -> tuple[triton.Config, ...]:
    """float32 (a testing dtype) gets small tiles, as in sigmoid_attention.py."""
    if fp32:
        blocks = [(64, 32, 4, 2)]
    elif cap[0] >= 9:
        blocks = [(128, 128, 8, 3), (128, 64, 4, 3), (64, 128, 4, 3)]
    else:
        blocks = [(64, 64, 4, 2)]
    return tuple(
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for m, n, w, s in blocks
    )


_TUNED: dict[tuple, object] = {}


# An opaque ``custom_op`` under torch.compile, as in sigmoid_attention.py (why: docs/LOG.md).
@torch.library.custom_op("stabilitylab::max_abs_logit", mutates_args=())
def _max_abs_logit_op(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    checked: bool,
    causal: bool = False,
) -> torch.Tensor:
    q, k = last_dim_contiguous(q), last_dim_contiguous(k)
    B, H, T, D = q.shape
    if not checked:  # traced by torch.compile, which skipped the lengths' range check
        check_lengths_at_launch(lengths, T)
    if interpreting():
        launch, blocks, min_bm = interpreted(_max_abs_logit_kernel), INTERPRETER_BLOCKS, 16
    else:
        cap, fp32 = capability(q.device), q.dtype == torch.float32
        configs = _configs(cap, fp32)
        strides = (*q.stride()[:3], *k.stride()[:3])
        key = (cap, fp32, specialization(q, k, lengths, *strides, H, T))  # see specialization
        if key not in _TUNED:
            _TUNED[key] = triton.autotune(
                configs=list(configs), key=["T_BUCKET", "HEAD_DIM", "CAUSAL"]
            )(compiled(_max_abs_logit_kernel))
        launch, blocks = _TUNED[key], {}
        min_bm = min(c.kwargs["BLOCK_M"] for c in configs)
    n_mx = cdiv(T, min_bm)
    mx = torch.zeros(B * H, n_mx, dtype=torch.float32, device=q.device)
    launch[lambda meta: (cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, mx, lengths,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        H, T, seq_bucket(T), n_mx, scale,
        HEAD_DIM=D, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", CAUSAL=causal,
        **blocks,
    )  # fmt: skip
    return mx.amax(dim=1).view(B, H)


@_max_abs_logit_op.register_fake
def _max_abs_logit_fake(q, k, lengths, scale, checked, causal=False):
    return q.new_empty(q.shape[:2], dtype=torch.float32)


def max_abs_logit(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Exact ``max |q.k| * scale`` over valid pairs per (batch, head), under ``causal`` only those
    with key <= query: float32 ``max_BH``, detached."""
    check_attention_inputs({"q_BHTD": q_BHTD, "k_BHTD": k_BHTD}, lengths_B, scale, None, causal)
    scale = 1.0 / math.sqrt(q_BHTD.shape[-1]) if scale is None else float(scale)
    checked = not torch.compiler.is_compiling()  # the range check above ran in eager only
    return _max_abs_logit_op(q_BHTD.detach(), k_BHTD.detach(), lengths_B, scale, checked, causal)
