"""Cross-entropy through a linear head without the full float32 logits.

``masked_lm_loss_sum(head(h_BTC), labels_BT)`` writes the logits of every position (B x T x V in
the autocast dtype), a float32 copy, float32 log-probabilities and, in the backward, float32 and
16-bit gradients of the same size: at T = 8192 and V = 44K about 1.4 GB each, most of it for
positions that predict nothing (the masked-token task labels 15%). Here:

- only labelled rows (labels != -100) go through the head (the rest contribute nothing to the
  loss nor to any gradient: the same function);
- rows go in chunks of at most ``max_chunk_elements`` logits, float32 only within a chunk;
- the gradients are computed in the forward (softmax - one-hot per chunk, then two GEMMs), kept,
  and scaled by the incoming gradient in the backward: the logits are never recomputed;
- on CUDA each chunk's loss and logit gradient come from one
  kernel (``stabilitylab.kernels.cross_entropy``) that reads the 16-bit logits twice and writes
  the gradient over them, instead of a float32 copy and about eight passes over it.

Numerics follow the eager path under autocast: h, W and b cast to the autocast dtype, logits in
that dtype, softmax in float32, logit gradients rounded to the autocast dtype for the two GEMMs
(their scale by the loss's weight happens after that rounding instead of before: a relative
difference of one rounding, ~2^-8 in bf16). ``dW`` and ``db`` accumulate over chunks in float32.

``row_multiple``: the GEMMs run on the weight's rows zero-padded to that multiple, the padded
logits set to -inf before the softmax, so they take probability 0 and gradient 0 (the same loss
and gradients; ``stabilitylab.model.head_linear`` says why an odd vocabulary is slow).

Cost: one host sync (the number of labelled rows sizes the gather), unless the caller knows
that number on the host (``n_labelled``: a batch counts its labels when it is built): then the
rows come from a stable sort of the mask, and nothing waits for the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stabilitylab.kernels.cross_entropy import cross_entropy_grad, cross_entropy_grad_reference
from stabilitylab.model import padded_size

IGNORE_INDEX = -100
# Logits per chunk by default: 2^27 (512 MiB in float32, 256 MiB in 16 bits).
MAX_CHUNK_ELEMENTS = 2**27


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's GEMM runs in: autocast's when it is on for h's device, else the
    promotion of h and the weight (what ``F.linear`` would do)."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(h.dtype, weight.dtype)


def rows_per_chunk(vocab: int, max_chunk_elements: int) -> int:
    """Rows per chunk so that a chunk holds at most ``max_chunk_elements`` logits (at least one)."""
    if max_chunk_elements < 1:
        raise ValueError(f"max_chunk_elements must be >= 1, got {max_chunk_elements}")
    return max(1, max_chunk_elements // vocab)


def labelled_rows(labels_N: torch.Tensor, n_labelled: int | None = None) -> torch.Tensor:
    """Indices of the labelled positions (label != -100), ascending. With ``n_labelled`` (their
    number, known on the host) the first ``n_labelled`` of a stable sort that puts labelled
    positions first, with no host sync; without it ``nonzero`` (one host sync)."""
    labelled_N = labels_N != IGNORE_INDEX
    if n_labelled is None:
        return labelled_N.nonzero()[:, 0]
    if isinstance(n_labelled, bool) or not isinstance(n_labelled, int):
        raise TypeError(f"n_labelled must be an int or None, got {n_labelled!r}")
    if not 0 <= n_labelled <= labels_N.numel():
        raise ValueError(f"n_labelled must lie in [0, {labels_N.numel()}], got {n_labelled}")
    order_N = torch.argsort((~labelled_N).to(torch.uint8), stable=True)
    return order_N[:n_labelled]


def fused_chunks(device: torch.device) -> bool:
    """Whether a chunk's loss and gradient come from the Triton kernel: on CUDA. (Tests run it in
    Triton's interpreter by replacing this function.)"""
    return device.type == "cuda"


class _LinearCrossEntropySum(torch.autograd.Function):
    """``sum_n CE(h_n W^T + b, y_n)`` over given rows; gradients made in the forward."""

    @staticmethod
    def forward(ctx, h_NC, weight_VC, bias_V, y_N, dtype, chunk_rows, row_multiple):
        V = weight_VC.shape[0]
        pad = padded_size(V, row_multiple) - V
        with torch.autocast(h_NC.device.type, enabled=False):
            w = weight_VC.to(dtype)
            b = bias_V.to(dtype) if bias_V is not None else None
            if pad:  # (V + pad, C): zero rows
                w = F.pad(w, (0, 0, 0, pad))
                b = None if b is None else F.pad(b, (0, pad))
            hc_NC = h_NC.to(dtype)
            loss = torch.zeros((), dtype=torch.float32, device=h_NC.device)
            dh_NC = torch.empty_like(hc_NC)
            dw_PC = torch.zeros(w.shape, dtype=torch.float32, device=h_NC.device)
            db_P = (
                None if b is None else torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
            )
            fused = fused_chunks(h_NC.device)
            for s in range(0, h_NC.shape[0], chunk_rows):
                h_RC, y_R = hc_NC[s : s + chunk_rows], y_N[s : s + chunk_rows]
                logits_RP = F.linear(h_RC, w, b)
                if fused:
                    loss_R, g_RP = cross_entropy_grad(logits_RP, y_R, V, in_place=True)
                else:  # the same maths in torch ops, float32 inside
                    loss_R, g_RP = cross_entropy_grad_reference(logits_RP, y_R, V)
                loss += loss_R.sum()
                torch.mm(g_RP, w, out=dh_NC[s : s + chunk_rows])
                dw_PC += (g_RP.t() @ h_RC).float()
                if db_P is not None:
                    db_P += g_RP.sum(0, dtype=torch.float32)
        ctx.save_for_backward(dh_NC, dw_PC[:V], None if db_P is None else db_P[:V])
        ctx.dtypes = (h_NC.dtype, weight_VC.dtype, None if bias_V is None else bias_V.dtype)
        return loss

    @staticmethod
    def backward(ctx, d_loss):
        dh_NC, dw_VC, db_V = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        dh = (dh_NC * d_loss.to(dh_NC.dtype)).to(h_dtype)
        dw = (dw_VC * d_loss).to(w_dtype)
        db = None if db_V is None else (db_V * d_loss).to(b_dtype)
        return dh, dw, db, None, None, None, None


def linear_cross_entropy_sum(
    h_BTC: torch.Tensor,
    weight_VC: torch.Tensor,
    bias_V: torch.Tensor | None,
    labels_BT: torch.Tensor,
    *,
    max_chunk_elements: int = MAX_CHUNK_ELEMENTS,
    row_multiple: int = 1,
    n_labelled: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of ``F.linear(h_BTC, weight_VC, bias_V)`` over positions whose label
    is not -100, float32: ``masked_lm_loss_sum(head(h), labels)`` without the full logits.
    Differentiable in h, the weight and the bias. Labels must lie in [0, V) (as for
    ``F.cross_entropy``; not checked here: that would be a second sync). ``row_multiple``: the
    GEMMs on the weight's rows padded to that multiple (module docstring); the same result.
    ``n_labelled``: the number of labelled positions, when the host knows it; it must be that
    number (not checked: that would be the sync it saves). None: counted on the device (a sync)."""
    if h_BTC.shape[:-1] != labels_BT.shape:
        raise ValueError(
            f"h_BTC {tuple(h_BTC.shape)} and labels_BT {tuple(labels_BT.shape)} disagree on (B, T)"
        )
    if weight_VC.dim() != 2 or weight_VC.shape[1] != h_BTC.shape[-1]:
        raise ValueError(
            f"weight_VC must be (V, C={h_BTC.shape[-1]}), got {tuple(weight_VC.shape)}"
        )
    labels_N = labels_BT.flatten()
    rows_N = labelled_rows(labels_N, n_labelled)
    h_NC = h_BTC.flatten(0, -2).index_select(0, rows_N)
    y_N = labels_N.index_select(0, rows_N)
    dtype = compute_dtype(h_BTC, weight_VC)
    padded_V = padded_size(weight_VC.shape[0], row_multiple)
    chunk = rows_per_chunk(padded_V, max_chunk_elements)
    return _LinearCrossEntropySum.apply(h_NC, weight_VC, bias_V, y_N, dtype, chunk, row_multiple)
