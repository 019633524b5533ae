"""Attention backends behind one signature, chosen by name.

Every backend is called as::

    out_BHTD, max_logit_BH = backend(q_BHTD, k_BHTD, v_BHTD, lengths_B,
                                     sigmoid_bias=None, return_max_logit=False)

- ``lengths_B``: valid tokens per sequence (right padding); padded keys contribute nothing and
  padded query rows of ``out_BHTD`` are zero.
- ``sigmoid_bias``: ``None`` means ``b = -log(n_valid)`` per sequence; a float is used as is.
  Softmax ignores it.
- ``max_logit_BH``: when asked, the exact ``max |q.k|/sqrt(d)`` over valid pairs (float32,
  detached), else ``None``. The backend returns it so a fused kernel can produce it for free.

Backends: ``softmax`` (PyTorch SDPA with a key-padding mask: the machine's best fused kernel
serves), ``softmax-reference`` and ``sigmoid-reference`` (plain PyTorch, n x n: slow, but
reproducible bit for bit on a GPU, which SDPA's backward is not), ``sigmoid-triton``
(stabilitylab.kernels) and ``sigmoid-triton-exact`` (the same with the exact sigmoid).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from stabilitylab.kernels.reference import (
    key_mask_BT,
    max_abs_logit_reference,
    sigmoid_attention_reference,
    softmax_attention_reference,
)
from stabilitylab.kernels.triton_support import lengths_all_full

AttentionResult = tuple[torch.Tensor, torch.Tensor | None]
AttentionBackend = Callable[..., AttentionResult]

_BACKENDS: dict[str, AttentionBackend] = {}


def register(name: str) -> Callable[[AttentionBackend], AttentionBackend]:
    def wrap(fn: AttentionBackend) -> AttentionBackend:
        _BACKENDS[name] = fn
        return fn

    return wrap


def available() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {available()}")
    return _BACKENDS[name]


def max_abs_logit(q_BHTD, k_BHTD, lengths_B) -> torch.Tensor:
    """Exact max |logit| per (batch, head) without an n x n tensor: Triton on CUDA, else chunks."""
    if q_BHTD.is_cuda:
        from stabilitylab.kernels.logit_max import max_abs_logit as fused

        return fused(q_BHTD, k_BHTD, lengths_B)
    return max_abs_logit_reference(q_BHTD, k_BHTD, lengths_B)


@register("softmax")
def softmax_sdpa(q_BHTD, k_BHTD, v_BHTD, lengths_B, *, sigmoid_bias=None, return_max_logit=False):
    T = q_BHTD.shape[2]
    valid_BT = key_mask_BT(lengths_B, T)
    if lengths_all_full(lengths_B, T):  # SDPA's unmasked kernel; one host read per lengths_B
        out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD)
    else:
        out_BHTD = F.scaled_dot_product_attention(
            q_BHTD, k_BHTD, v_BHTD, attn_mask=valid_BT[:, None, None, :]
        )
    out_BHTD = out_BHTD * valid_BT[:, None, :, None].to(out_BHTD.dtype)
    stats = max_abs_logit(q_BHTD, k_BHTD, lengths_B) if return_max_logit else None
    return out_BHTD, stats


@register("softmax-reference")
def softmax_reference(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, sigmoid_bias=None, return_max_logit=False
):
    out_BHTD = softmax_attention_reference(q_BHTD, k_BHTD, v_BHTD, lengths_B)
    stats = max_abs_logit(q_BHTD, k_BHTD, lengths_B) if return_max_logit else None
    return out_BHTD, stats


@register("sigmoid-reference")
def sigmoid_reference(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, sigmoid_bias=None, return_max_logit=False
):
    out_BHTD = sigmoid_attention_reference(q_BHTD, k_BHTD, v_BHTD, lengths_B, bias=sigmoid_bias)
    stats = max_abs_logit(q_BHTD, k_BHTD, lengths_B) if return_max_logit else None
    return out_BHTD, stats


@register("sigmoid-triton")
def sigmoid_triton(q_BHTD, k_BHTD, v_BHTD, lengths_B, *, sigmoid_bias=None, return_max_logit=False):
    from stabilitylab.kernels import sigmoid_attention

    return sigmoid_attention(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, bias=sigmoid_bias, return_max_logit=return_max_logit
    )


@register("sigmoid-triton-exact")
def sigmoid_triton_exact(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, sigmoid_bias=None, return_max_logit=False
):
    """``sigmoid-triton`` with the exact sigmoid ``1 / (1 + exp(-x))`` in place of the fast
    ``tanh.approx.f32`` one: to check that the approximation does not change a run's fate."""
    from stabilitylab.kernels import sigmoid_attention

    return sigmoid_attention(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, bias=sigmoid_bias, return_max_logit=return_max_logit,
        exact=True,
    )  # fmt: skip
