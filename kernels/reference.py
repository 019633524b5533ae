"""Plain-PyTorch references for the attention kernels: the maths the Triton kernels must match.

Layout: ``q_BHTD, k_BHTD, v_BHTD`` (batch, heads, tokens, head dim), right padding described by
``lengths_B`` (number of valid tokens per sequence, 1 <= L <= T). The *logit* of a pair is
``s_ij = scale * q_i . k_j``: neither the sigmoid bias nor a per-key bias is part of it, so the
softmax and sigmoid arms report comparable magnitudes.

Which pairs count: key ``j`` is *visible* to query ``i`` when ``j < L_b`` and, under
``causal=True``, ``j <= i``. Outputs of padded query rows (``i >= L_b``) are zero. A hidden pair
and a padded row are left out by selection, never by multiplying with 0: whatever padding holds
never reaches a result, and a non-finite value in a valid position reaches exactly the results
its pairs reach (an inf in q_i: out_i by IEEE rules, max|logit| = inf; the kernels agree, though
they read padding as zeros, where q_i . 0 = inf * 0 = NaN).

A per-key additive bias (the KV-eviction gate's ``log(g_j + eps)``) is added to every query's
score for key ``j``: ``key_bias_BT`` (shared by the heads) or ``key_bias_BHT`` (one per head), at
most one of the two. It is differentiable: autograd through these functions gives its gradient,
``d bias_j = sum_i dS_ij`` (over heads too for ``key_bias_BT``).

These functions materialise at most one chunk of scores at a time (``max_abs_logit_reference``)
or the full n x n matrix (the attention references: that is what "eager" means here).
"""

from __future__ import annotations

import math

import torch


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def key_mask_BT(lengths_B: torch.Tensor, T: int) -> torch.Tensor:
    """True where a token is valid (position < length)."""
    return torch.arange(T, device=lengths_B.device)[None, :] < lengths_B[:, None]


def visible_BTT(lengths_B: torch.Tensor, T: int, causal: bool) -> torch.Tensor:
    """``[b, i, j]`` True where key ``j`` is visible to query ``i``: ``j < L_b`` (and ``j <= i``
    under ``causal``). Padded query rows keep their visible keys, so no row is empty."""
    visible_BTT = key_mask_BT(lengths_B, T)[:, None, :].expand(-1, T, -1)
    if causal:
        visible_BTT = (
            visible_BTT & torch.ones(T, T, dtype=torch.bool, device=lengths_B.device).tril()
        )
    return visible_BTT


def sigmoid_bias_B(lengths_B: torch.Tensor, bias: float | None) -> torch.Tensor:
    """Per-sequence bias: ``-log(n_valid)`` when ``bias`` is None, else the given number.

    Under ``causal=True`` the lab keeps ``-log(n_valid)`` of the whole sequence for every row (the
    encoder's rule; the KV-eviction paper does not state its b). Row ``i`` sees ``i + 1`` keys, so
    early rows carry less total mass than ``-log(i + 1)`` would give them.
    """
    if bias is None:
        return -torch.log(lengths_B.to(torch.float32))
    return torch.full(lengths_B.shape, float(bias), dtype=torch.float32, device=lengths_B.device)


def key_bias_BH1T(
    q_BHTD: torch.Tensor,
    key_bias_BT: torch.Tensor | None,
    key_bias_BHT: torch.Tensor | None,
) -> torch.Tensor | None:
    """The per-key bias shaped to broadcast over scores ``(B, H, T, T)``: ``(B, H or 1, 1, T)``,
    or None when there is none. Refuses both at once and wrong shapes, naming the argument."""
    B, H, T, _ = q_BHTD.shape
    if key_bias_BT is not None and key_bias_BHT is not None:
        raise ValueError("pass key_bias_BT or key_bias_BHT, not both")
    if key_bias_BT is not None:
        if tuple(key_bias_BT.shape) != (B, T):
            raise ValueError(
                f"key_bias_BT must have shape {(B, T)}, got {tuple(key_bias_BT.shape)}"
            )
        return key_bias_BT[:, None, None, :]
    if key_bias_BHT is not None:
        if tuple(key_bias_BHT.shape) != (B, H, T):
            raise ValueError(
                f"key_bias_BHT must have shape {(B, H, T)}, got {tuple(key_bias_BHT.shape)}"
            )
        return key_bias_BHT[:, :, None, :]
    return None


def _scores_BHTT(q_BHTD, k_BHTD, scale, bias_BH1T) -> torch.Tensor:
    s_BHTT = torch.matmul(q_BHTD, k_BHTD.transpose(-1, -2)) * scale
    return s_BHTT if bias_BH1T is None else s_BHTT + bias_BH1T.to(s_BHTT.dtype)


def sigmoid_attention_reference(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
    bias: float | None = None,
    *,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    key_bias_BHT: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out_i = sum_{j visible} sigmoid(scale q_i.k_j + b + kb_j) v_j``; padded rows are zero.

    ``b`` per sequence (``sigmoid_bias_B``), ``kb`` the per-key bias (module docstring). Computed
    in the inputs' dtype (pass float64 for a ground truth); both biases are added in that dtype.
    """
    B, H, T, D = q_BHTD.shape
    scale = default_scale(D) if scale is None else scale
    bias_BH1T = key_bias_BH1T(q_BHTD, key_bias_BT, key_bias_BHT)
    b_B = sigmoid_bias_B(lengths_B, bias).to(q_BHTD.dtype)
    s_BHTT = _scores_BHTT(q_BHTD, k_BHTD, scale, bias_BH1T) + b_B[:, None, None, None]
    visible_B1TT = visible_BTT(lengths_B, T, causal)[:, None]
    p_BHTT = torch.where(visible_B1TT, torch.sigmoid(s_BHTT), 0.0)
    out_BHTD = torch.matmul(p_BHTT, v_BHTD)
    return torch.where(key_mask_BT(lengths_B, T)[:, None, :, None], out_BHTD, 0.0)


def softmax_attention_reference(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
    *,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    key_bias_BHT: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = softmax_j(scale q_i.k_j + kb_j over visible j) v``; padded query rows are zero.

    The eager softmax arm: plain matmuls and softmax in the inputs' dtype, the n x n matrix
    materialised. Unlike SDPA's fused backward (which accumulates with atomics), it is
    bit-for-bit reproducible on a GPU, run to run.
    """
    B, H, T, D = q_BHTD.shape
    scale = default_scale(D) if scale is None else scale
    bias_BH1T = key_bias_BH1T(q_BHTD, key_bias_BT, key_bias_BHT)
    s_BHTT = _scores_BHTT(q_BHTD, k_BHTD, scale, bias_BH1T)
    visible_B1TT = visible_BTT(lengths_B, T, causal)[:, None]
    s_BHTT = s_BHTT.masked_fill(~visible_B1TT, float("-inf"))
    out_BHTD = torch.matmul(torch.softmax(s_BHTT, dim=-1), v_BHTD)
    return torch.where(key_mask_BT(lengths_B, T)[:, None, :, None], out_BHTD, 0.0)


def max_abs_logit_reference(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    scale: float | None = None,
    chunk_elems: int = 1 << 26,
    *,
    causal: bool = False,
) -> torch.Tensor:
    """Exact ``max |scale * q_i . k_j|`` per (batch, head) over pairs of valid tokens (``i, j <
    L_b``; under ``causal`` also ``j <= i``): ``max_BH``. No bias of any kind is part of it.

    Never holds more than ``chunk_elems`` scores at once (query chunks), so it runs at 8K
    context without an n x n tensor. Returns float32, detached.
    """
    B, H, T, D = q_BHTD.shape
    scale = default_scale(D) if scale is None else scale
    valid_BT = key_mask_BT(lengths_B, T)
    q_BHTD, k_BHTD = q_BHTD.detach(), k_BHTD.detach()
    chunk = max(1, min(T, chunk_elems // max(1, B * H * T)))
    out_BH = torch.zeros(B, H, dtype=torch.float32, device=q_BHTD.device)
    pos_T = torch.arange(T, device=q_BHTD.device)
    for start in range(0, T, chunk):
        stop = min(T, start + chunk)
        s_BHCT = torch.matmul(q_BHTD[:, :, start:stop].float(), k_BHTD.float().transpose(-1, -2))
        pair_BCT = valid_BT[:, start:stop, None] & valid_BT[:, None, :]
        if causal:
            pair_BCT = pair_BCT & (pos_T[None, None, :] <= pos_T[start:stop, None])
        s_BHCT = s_BHCT.abs().masked_fill(~pair_BCT[:, None], 0.0)
        out_BH = torch.maximum(out_BH, s_BHCT.amax(dim=(-1, -2)))
    return out_BH * scale
