"""Plain-PyTorch references for the attention kernels: the maths the Triton kernels must match.

Layout: ``q_BHTD, k_BHTD, v_BHTD`` (batch, heads, tokens, head dim), right padding described by
``lengths_B`` (number of valid tokens per sequence, 1 <= L <= T). The *logit* of a pair is
``s_ij = scale * q_i . k_j`` (the bias of sigmoid attention is not part of it), so the softmax and
sigmoid arms report comparable magnitudes.

These functions materialise at most one chunk of scores at a time (``max_abs_logit_reference``)
or the full n x n matrix (``sigmoid_attention_reference``: that is what "eager" means here).
"""

from __future__ import annotations

import math

import torch


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def key_mask_BT(lengths_B: torch.Tensor, T: int) -> torch.Tensor:
    """True where a token is valid (position < length)."""
    return torch.arange(T, device=lengths_B.device)[None, :] < lengths_B[:, None]


def sigmoid_bias_B(lengths_B: torch.Tensor, bias: float | None) -> torch.Tensor:
    """Per-sequence bias: ``-log(n_valid)`` when ``bias`` is None, else the given number."""
    if bias is None:
        return -torch.log(lengths_B.to(torch.float32))
    return torch.full(lengths_B.shape, float(bias), dtype=torch.float32, device=lengths_B.device)


def sigmoid_attention_reference(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
    bias: float | None = None,
) -> torch.Tensor:
    """``out = sigmoid(q k^T * scale + b) v`` over valid keys; padded query rows are zero.

    Computed in the inputs' dtype (pass float64 for a ground truth); the bias is added in that
    dtype too.
    """
    B, H, T, D = q_BHTD.shape
    scale = default_scale(D) if scale is None else scale
    valid_BT = key_mask_BT(lengths_B, T)
    b_B = sigmoid_bias_B(lengths_B, bias).to(q_BHTD.dtype)
    s_BHTT = torch.matmul(q_BHTD, k_BHTD.transpose(-1, -2)) * scale + b_B[:, None, None, None]
    p_BHTT = torch.sigmoid(s_BHTT) * valid_BT[:, None, None, :].to(q_BHTD.dtype)
    out_BHTD = torch.matmul(p_BHTT, v_BHTD)
    return out_BHTD * valid_BT[:, None, :, None].to(out_BHTD.dtype)


def softmax_attention_reference(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``out = softmax(q k^T * scale) v`` over valid keys; padded query rows are zero.

    The eager softmax arm: plain matmuls and softmax in the inputs' dtype, the n x n matrix
    materialised. Unlike SDPA's fused backward (which accumulates with atomics), it is
    bit-for-bit reproducible on a GPU, run to run.
    """
    B, H, T, D = q_BHTD.shape
    scale = default_scale(D) if scale is None else scale
    valid_BT = key_mask_BT(lengths_B, T)
    s_BHTT = torch.matmul(q_BHTD, k_BHTD.transpose(-1, -2)) * scale
    s_BHTT = s_BHTT.masked_fill(~valid_BT[:, None, None, :], float("-inf"))
    out_BHTD = torch.matmul(torch.softmax(s_BHTT, dim=-1), v_BHTD)
    return out_BHTD * valid_BT[:, None, :, None].to(out_BHTD.dtype)


def max_abs_logit_reference(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
    chunk_elems: int = 1 << 26,
) -> torch.Tensor:
    """Exact ``max |scale * q_i . k_j|`` over valid (i, j) pairs, per (batch, head): ``max_BH``.

    Never holds more than ``chunk_elems`` scores at once (query chunks), so it runs at 8K
    context without an n x n tensor. Returns float32, detached.
    """
    B, H, T, D = q_BHTD.shape
    scale = default_scale(D) if scale is None else scale
    valid_BT = key_mask_BT(lengths_B, T)
    q_BHTD, k_BHTD = q_BHTD.detach(), k_BHTD.detach()
    chunk = max(1, min(T, chunk_elems // max(1, B * H * T)))
    out_BH = torch.zeros(B, H, dtype=torch.float32, device=q_BHTD.device)
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        s_BHCT = torch.matmul(q_BHTD[:, :, start:stop].float(), k_BHTD.float().transpose(-1, -2))
        pair_BCT = valid_BT[:, start:stop, None] & valid_BT[:, None, :]
        s_BHCT = s_BHCT.abs().masked_fill(~pair_BCT[:, None], 0.0)
        out_BH = torch.maximum(out_BH, s_BHCT.amax(dim=(-1, -2)))
    return out_BH * scale
