"""A tiny n x n attention for the eviction probes: explicit weights, any key mask, both kinds.

Layout: ``q_BHTD, k_BHTD, v_BHTD`` (batch, heads, tokens, head dim); right padding given by
``lengths_B`` (valid tokens per sequence, 1 <= L <= T). For query i and key j::

    z_ij = scale * q_i . k_j + key_bias_j                      (scale = 1/sqrt(D) by default)
    visible(i, j) = i < L and j < L and not removed_j and (j <= i if causal)
    softmax:  a_ij = exp(z_ij) / sum_{j' visible} exp(z_ij')   over visible j, else 0
    sigmoid:  a_ij = sigmoid(z_ij + b)                         over visible j, else 0
    o_i = sum_j a_ij * v~_j,   v~_j = 0 where removed_j, else v_j

``key_bias_BT`` is the gate's ``log(g_j + 1e-8)`` (the value scaling ``g_j v_j`` belongs to the
model, before this call). ``b`` is ``-log(L)`` per sequence when ``sigmoid_bias`` is None (the
lab's default, as in ``stabilitylab.kernels.reference``; the paper does not state its bias), else
the given float. Removing keys does not change ``b``: it is fixed by the sequence, so the probes
measure the loss of support alone. A query row with no visible key (a padded row, or every key
removed) gives zero weights and a zero output, under softmax too.

Why a local copy rather than the kernels' reference: the probes need the weights themselves
(row sums) and an arbitrary key mask; this file stays small and is checked against a loop.
It materialises ``B*H*T*T`` weights: fine for probe batches at T = 512, not for long contexts.
"""

from __future__ import annotations

import math

import torch

KINDS = ("softmax", "sigmoid")


def check_qkv(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    v_BHTD: torch.Tensor | None = None,
    key_bias_BT: torch.Tensor | None = None,
) -> None:
    """One-line ``ValueError``s for shapes that do not fit the layout above."""
    if q_BHTD.dim() != 4:
        raise ValueError(f"q_BHTD must have 4 dims (B, H, T, D), got shape {tuple(q_BHTD.shape)}")
    B, H, T, D = q_BHTD.shape
    if k_BHTD.shape != q_BHTD.shape:
        raise ValueError(f"k_BHTD shape {tuple(k_BHTD.shape)} != q_BHTD shape {(B, H, T, D)}")
    if v_BHTD is not None and v_BHTD.shape[:3] != (B, H, T):
        raise ValueError(f"v_BHTD shape {tuple(v_BHTD.shape)} must start with {(B, H, T)}")
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths_B shape {tuple(lengths_B.shape)} != ({B},)")
    if key_bias_BT is not None and key_bias_BT.shape != (B, T):
        raise ValueError(f"key_bias_BT shape {tuple(key_bias_BT.shape)} != {(B, T)}")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown attention kind {kind!r}; choose one of {KINDS}")


def visible_BTT(
    lengths_B: torch.Tensor,
    T: int,
    causal: bool = False,
    removed_BT: torch.Tensor | None = None,
) -> torch.Tensor:
    """``visible[b, i, j]``: query i of sequence b may attend to key j (see the module doc)."""
    valid_BT = torch.arange(T, device=lengths_B.device)[None, :] < lengths_B[:, None]
    keys_BT = valid_BT if removed_BT is None else valid_BT & ~removed_BT.to(torch.bool)
    vis_BTT = valid_BT[:, :, None] & keys_BT[:, None, :]
    if causal:
        vis_BTT = vis_BTT & torch.ones(T, T, dtype=torch.bool, device=lengths_B.device).tril()
    return vis_BTT


def sigmoid_bias_B(lengths_B: torch.Tensor, bias: float | None, dtype: torch.dtype) -> torch.Tensor:
    """``-log(L_b)`` per sequence when ``bias`` is None, else ``bias`` for every sequence."""
    if bias is None:
        return -torch.log(lengths_B.to(dtype))
    return torch.full(lengths_B.shape, float(bias), dtype=dtype, device=lengths_B.device)


def attention_weights_BHTT(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    kind: str,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    sigmoid_bias: float | None = None,
    removed_BT: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """The weights ``a_BHTT`` of the module doc, zero where a pair is not visible.

    Computed in the inputs' dtype: pass float64 for a ground truth.
    """
    check_kind(kind)
    check_qkv(q_BHTD, k_BHTD, lengths_B, key_bias_BT=key_bias_BT)
    B, H, T, D = q_BHTD.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    z_BHTT = torch.matmul(q_BHTD, k_BHTD.transpose(-1, -2)) * scale
    if key_bias_BT is not None:
        z_BHTT = z_BHTT + key_bias_BT.to(z_BHTT.dtype)[:, None, None, :]
    vis_BHTT = visible_BTT(lengths_B, T, causal, removed_BT)[:, None]
    if kind == "sigmoid":
        b_B = sigmoid_bias_B(lengths_B, sigmoid_bias, z_BHTT.dtype)
        return torch.sigmoid(z_BHTT + b_B[:, None, None, None]) * vis_BHTT
    # Softmax by hand so that an empty row gives zeros, not the NaN of softmax(-inf, ..., -inf).
    z_BHTT = z_BHTT.masked_fill(~vis_BHTT, float("-inf"))
    m_BHT1 = z_BHTT.amax(dim=-1, keepdim=True)
    m_BHT1 = torch.where(torch.isfinite(m_BHT1), m_BHT1, torch.zeros_like(m_BHT1))
    e_BHTT = torch.exp(z_BHTT - m_BHT1) * vis_BHTT
    denom_BHT1 = e_BHTT.sum(dim=-1, keepdim=True)
    return torch.where(denom_BHT1 > 0, e_BHTT / denom_BHT1, torch.zeros_like(e_BHTT))


def masked_attention_BHTD(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    kind: str,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    sigmoid_bias: float | None = None,
    removed_BT: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """``o_BHTD = a_BHTT @ v~_BHTD`` (module doc); padded query rows are zero.

    Zeroing the removed values is redundant once their weights are exactly 0; it is kept because
    the paper's probe does both, and it keeps the output right for any caller that passes
    finite-masked weights.
    """
    check_qkv(q_BHTD, k_BHTD, lengths_B, v_BHTD=v_BHTD, key_bias_BT=key_bias_BT)
    a_BHTT = attention_weights_BHTT(
        q_BHTD,
        k_BHTD,
        lengths_B,
        kind=kind,
        causal=causal,
        key_bias_BT=key_bias_BT,
        sigmoid_bias=sigmoid_bias,
        removed_BT=removed_BT,
        scale=scale,
    )
    if removed_BT is not None:
        v_BHTD = v_BHTD * (~removed_BT.to(torch.bool))[:, None, :, None]
    return torch.matmul(a_BHTT.to(v_BHTD.dtype), v_BHTD)
