"""Attention backends behind one signature, chosen by name.

Every backend is called as::

    out_BHTD, max_logit_BH = backend(q_BHTD, k_BHTD, v_BHTD, lengths_B, *,
                                     causal=False, key_bias_BT=None, key_bias_BHT=None,
                                     sigmoid_bias=None, return_max_logit=False)

- ``lengths_B``: valid tokens per sequence (right padding); padded keys contribute nothing and
  padded query rows of ``out_BHTD`` are zero.
- ``causal``: query ``i`` sees keys ``j <= i`` only (the decoder).
- ``key_bias_BT`` / ``key_bias_BHT``: an additive bias on every query's logit for key ``j``,
  shared by the heads or one per head (the KV-eviction gate's ``log(g_j + eps)``); at most one
  of the two; differentiable. The gate's value scaling ``g_j v_j`` happens in the model.
- ``sigmoid_bias``: ``None`` means ``b = -log(n_valid)`` per sequence (also under ``causal``:
  the lab's choice, see ``kernels/reference.py::sigmoid_bias_B``); a float is used as is.
  Softmax ignores it.
- ``max_logit_BH``: when asked, the exact ``max |q.k|/sqrt(d)`` over valid (and, under
  ``causal``, visible) pairs, no bias in it (float32, detached), else ``None``. The backend
  returns it so a fused kernel can produce it for free.

A backend that cannot honour an argument refuses it by name (``ValueError``).

Backends:

- ``softmax``: PyTorch SDPA. ``is_causal`` when nothing is padded and no bias is given, a
  boolean mask for padding/causal without a bias, else an additive float mask (bias, ``-inf``
  where masked) of ``B x T x T`` elements for causal.
- ``softmax-flex``: FlexAttention, a ``score_mod`` adding the key bias and a block mask for
  causal and padding (skips fully masked tiles), the mask built eagerly (a graph break inside a
  compiled model: in the graph it does not compile at a dynamic length). Compiled on CUDA; on
  CPU it runs eagerly (unfused, n x n) and torch has no CPU backward for it, so it is refused
  there when a gradient is needed.
- ``softmax-reference``, ``sigmoid-reference``: plain PyTorch, n x n; slow, but reproducible bit
  for bit on a GPU, which SDPA's backward is not. Support everything.
- ``sigmoid-triton`` (stabilitylab.kernels) and ``sigmoid-triton-exact`` (the same with the exact
  sigmoid): everything, fused (causal tiles skipped, the key bias and its gradient in the kernel).
- ``softmax-triton`` (stabilitylab.kernels): the softmax twin of ``sigmoid-triton``, on the same
  tiles and loops (online softmax), everything, fused; no atomics, reproducible bit for bit.
- ``softmax-flash``: SDPA held to its flash kernel, which takes no mask: causal only, no padding
  (every L_b == T) and no key bias, refused by name. Under ``torch.use_deterministic_algorithms``
  its backward repeats bit for bit (slower than without; seen on an H200).

Under ``torch.use_deterministic_algorithms(True)`` (``train.deterministic``) the same inputs give
the same bits run to run with every backend but ``softmax`` (SDPA: its backward accumulates in
varying order, and cuDNN refuses deterministic mode) and ``softmax-flex`` (the key bias's gradient
is scattered with atomic adds): ``NOT_DETERMINISTIC``, defined in stabilitylab.config, which
validates ``train.deterministic`` without torch. The flag makes flash's backward deterministic and
pins the Triton kernels' launch configs (``sigmoid_attention.pinned_config``); within one process
the Triton kernels and the references repeat without it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stabilitylab.config import (
    NOT_DETERMINISTIC,  # noqa: F401  (re-exported: the registry's)
    TRITON_HEAD_DIMS,
)
from stabilitylab.kernels.reference import (
    key_bias_BH1T,
    key_mask_BT,
    max_abs_logit_reference,
    sigmoid_attention_reference,
    softmax_attention_reference,
    visible_BTT,
)
from stabilitylab.kernels.triton_support import LastTensorMemo, lengths_all_full

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


def max_abs_logit(q_BHTD, k_BHTD, lengths_B, causal: bool = False) -> torch.Tensor:
    """Exact max |logit| per (batch, head) without an n x n tensor: Triton on CUDA for the head
    dims the kernel takes, else chunks."""
    if q_BHTD.is_cuda and q_BHTD.shape[-1] in TRITON_HEAD_DIMS:
        from stabilitylab.kernels.logit_max import max_abs_logit as fused

        return fused(q_BHTD, k_BHTD, lengths_B, causal=causal)
    return max_abs_logit_reference(q_BHTD, k_BHTD, lengths_B, causal=causal)


def _stats(q_BHTD, k_BHTD, lengths_B, causal, return_max_logit) -> torch.Tensor | None:
    return max_abs_logit(q_BHTD, k_BHTD, lengths_B, causal) if return_max_logit else None


def _zero_padded_rows(out_BHTD: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    valid_BT = key_mask_BT(lengths_B, out_BHTD.shape[2])
    return out_BHTD * valid_BT[:, None, :, None].to(out_BHTD.dtype)


# ---- softmax: SDPA ----------------------------------------------------------------------------


# Whether the batch a compiled model is running has no padding, set by ``unpadded_hint``.
# A traced function cannot read the lengths on the host; torch.compile reads this global as a
# constant and guards on it (one graph per value).
_UNPADDED_UNDER_COMPILE = False


@contextlib.contextmanager
def unpadded_hint(unpadded: bool):
    """Around a compiled model's forward: tell the traced ``softmax`` backend whether no row of
    the batch is padded (every length equals T), known to the caller without a device read (the
    trainer has the lengths on the host). Without it a compiled ``softmax`` model always passes
    SDPA a mask (right for any lengths, but SDPA's flash and cuDNN kernels take none).
    ``softmax-flex`` builds its block mask eagerly, outside the graph, and reads the lengths
    itself. A wrong True drops the padding mask: only say it when it holds. No effect in eager."""
    global _UNPADDED_UNDER_COMPILE
    before = _UNPADDED_UNDER_COMPILE
    _UNPADDED_UNDER_COMPILE = bool(unpadded)
    try:
        yield
    finally:
        _UNPADDED_UNDER_COMPILE = before


def compiled_lengths_hint(lengths_B: torch.Tensor, T: int):
    """``unpadded_hint`` read from ``lengths_B``, eagerly (``lengths_all_full``: one sync per new
    lengths tensor, as in eager)."""
    return unpadded_hint(lengths_all_full(lengths_B, T))


def _unpadded(lengths_B: torch.Tensor, T: int) -> bool:
    if torch.compiler.is_compiling():
        return _UNPADDED_UNDER_COMPILE
    return lengths_all_full(lengths_B, T)  # one host read per lengths_B (memo)


def sdpa_mask(lengths_B, T: int, causal: bool, bias_BH1T, dtype) -> torch.Tensor | None:
    """SDPA's ``attn_mask`` for padding, causality and a key bias: ``None`` when only causality
    (or nothing) masks (SDPA's ``is_causal`` / unmasked kernels serve), a boolean mask without a
    bias, else the additive float mask ``bias + (-inf where not visible)`` in ``dtype``."""
    full = _unpadded(lengths_B, T)
    if bias_BH1T is None and full:
        return None
    if causal:
        visible_B1QT = visible_BTT(lengths_B, T, causal=True)[:, None]
    else:
        visible_B1QT = key_mask_BT(lengths_B, T)[:, None, None, :]
    if bias_BH1T is None:
        return visible_B1QT
    bias_BH1T = bias_BH1T.to(dtype)
    if full and not causal:
        return bias_BH1T
    return torch.where(visible_B1QT, bias_BH1T, float("-inf"))


@register("softmax")
def softmax_sdpa(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False,
):  # fmt: skip
    T = q_BHTD.shape[2]
    bias_BH1T = key_bias_BH1T(q_BHTD, key_bias_BT, key_bias_BHT)
    mask = sdpa_mask(lengths_B, T, causal, bias_BH1T, q_BHTD.dtype)
    if mask is None:
        out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, is_causal=causal)
    else:
        out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=mask)
    out_BHTD = _zero_padded_rows(out_BHTD, lengths_B)
    return out_BHTD, _stats(q_BHTD, k_BHTD, lengths_B, causal, return_max_logit)


SDPA_KERNELS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
"""``torch.nn.attention.SDPBackend``'s values by name, as ``torch._fused_sdp_choice`` returns them."""


def sdpa_kernel_choice(
    q_BHTD: torch.Tensor, lengths_B: torch.Tensor, causal: bool, bias_BH1T=None
) -> str:
    """The kernel PyTorch's SDPA dispatcher picks for the ``softmax`` backend's call on inputs
    shaped like ``q_BHTD`` with these lengths and key bias (the mask ``sdpa_mask`` builds):
    ``torch._fused_sdp_choice`` (private; ``unknown`` where it is missing or says another)."""
    choice = getattr(torch, "_fused_sdp_choice", None)
    if choice is None:
        return "unknown"
    mask = sdpa_mask(lengths_B, q_BHTD.shape[2], causal, bias_BH1T, q_BHTD.dtype)
    picked = choice(q_BHTD, q_BHTD, q_BHTD, mask, 0.0, causal and mask is None)
    return SDPA_KERNELS.get(int(picked), "unknown")


def sdpa_kernels(
    B: int, H: int, T: int, D: int, dtype, device, causal: bool, key_bias: bool = False
) -> dict[str, str]:
    """The SDPA kernel of each call form the ``softmax`` backend makes at this shape: a batch
    with no padding (no mask) and one with (a boolean mask); with ``key_bias`` (a gated model:
    its layers after the first add the gates' key bias) the same two with the additive mask too.
    They can differ: a run with jagged lengths mixes them. For provenance: which kernel ran,
    when a softmax run fails."""
    q_BHTD = torch.zeros(B, H, T, D, dtype=dtype, device=device)
    full_B = torch.full((B,), T, device=device)
    padded_B = full_B.clone()
    padded_B[-1] = max(1, T - 1)
    biases = {"": None}
    if key_bias:
        biases[", key bias"] = torch.zeros(B, H, 1, T, dtype=dtype, device=device)
    return {
        f"{form}{suffix}": sdpa_kernel_choice(q_BHTD, lengths_B, causal, bias_BH1T)
        for suffix, bias_BH1T in biases.items()
        for form, lengths_B in (("unpadded", full_B), ("padded", padded_B))
    }


# ---- softmax: FlexAttention -------------------------------------------------------------------

_flex_masks = LastTensorMemo()
_compiled_flex: Callable | None = None


@torch.compiler.disable
def flex_block_mask(lengths_B: torch.Tensor, T: int, causal: bool):
    """FlexAttention's block mask for padding (``j < L_b``) and causality (``j <= i``), or None
    when nothing is masked. Built once per lengths tensor (memo): every layer reuses it.

    Always eager, also inside a compiled model (a graph break; the fast step then compiles with
    graph breaks): built in the graph at a dynamic sequence length, the mask does not lower in
    inductor (torch 2.11 on the H200: ``CantSplit`` on its block count), and the fast step fell
    back to an eager model, 5.7x slower (docs/LOG.md, 2026-12-03)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def build():
        if lengths_all_full(lengths_B, T) and not causal:
            return None

        def mask_mod(b, h, q_idx, kv_idx):
            keep = kv_idx < lengths_B[b]
            return keep & (kv_idx <= q_idx) if causal else keep

        return create_block_mask(mask_mod, lengths_B.shape[0], None, T, T, device=lengths_B.device)

    return _flex_masks.get(lengths_B, (T, causal), build)


def flex_score_mod(key_bias_BT, key_bias_BHT):
    """``score_mod`` adding the per-key bias to each score, or None without a bias."""
    if key_bias_BT is not None:
        return lambda score, b, h, q_idx, kv_idx: score + key_bias_BT[b, kv_idx]
    if key_bias_BHT is not None:
        return lambda score, b, h, q_idx, kv_idx: score + key_bias_BHT[b, h, kv_idx]
    return None


def _flex_attention(device: torch.device) -> Callable:
    """``flex_attention`` itself on CPU (eager; inductor's CPU template has no backward either)
    and inside a compiled model; compiled once on CUDA, where eager would run the n x n path."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


@contextlib.contextmanager
def _quiet_eager_flex():
    """CPU only: FlexAttention's "called without torch.compile()" notice; there is no faster CPU
    path to take instead."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


@register("softmax-flex")
def softmax_flex(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False,
):  # fmt: skip
    T = q_BHTD.shape[2]
    key_bias_BH1T(q_BHTD, key_bias_BT, key_bias_BHT)  # shape checks, named
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q_BHTD, k_BHTD, v_BHTD, key_bias_BT, key_bias_BHT)
    )  # fmt: skip
    if q_BHTD.device.type == "cpu" and needs_grad:
        raise ValueError(
            f"attention backend 'softmax-flex' has no backward on CPU (torch {torch.__version__}"
            "'s FlexAttention); use 'softmax' or 'softmax-reference' to train on CPU"
        )
    block_mask = flex_block_mask(lengths_B, T, causal)
    score_mod = flex_score_mod(key_bias_BT, key_bias_BHT)
    # Dynamo does not trace the warnings filters: they only guard the eager call.
    with contextlib.nullcontext() if torch.compiler.is_compiling() else _quiet_eager_flex():
        out_BHTD = _flex_attention(q_BHTD.device)(
            q_BHTD, k_BHTD, v_BHTD, score_mod=score_mod, block_mask=block_mask
        )
    out_BHTD = _zero_padded_rows(out_BHTD, lengths_B)
    return out_BHTD, _stats(q_BHTD, k_BHTD, lengths_B, causal, return_max_logit)


# ---- references -------------------------------------------------------------------------------


@register("softmax-reference")
def softmax_reference(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False,
):  # fmt: skip
    out_BHTD = softmax_attention_reference(
        q_BHTD, k_BHTD, v_BHTD, lengths_B,
        causal=causal, key_bias_BT=key_bias_BT, key_bias_BHT=key_bias_BHT,
    )  # fmt: skip
    return out_BHTD, _stats(q_BHTD, k_BHTD, lengths_B, causal, return_max_logit)


@register("sigmoid-reference")
def sigmoid_reference(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False,
):  # fmt: skip
    out_BHTD = sigmoid_attention_reference(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, bias=sigmoid_bias,
        causal=causal, key_bias_BT=key_bias_BT, key_bias_BHT=key_bias_BHT,
    )  # fmt: skip
    return out_BHTD, _stats(q_BHTD, k_BHTD, lengths_B, causal, return_max_logit)


# ---- sigmoid: the Triton kernel -------------------------------------------------------------

GATE_IN_KERNEL = frozenset({"sigmoid-triton", "sigmoid-triton-exact"})
"""Backends that take the KV-eviction gate itself (``gate_BT`` / ``gate_BHT``: log g and g v in
the kernel) where ``model.gate_in_kernel`` asks for it."""


@register("sigmoid-triton")
def sigmoid_triton(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False, gate_BT=None, gate_BHT=None,
):  # fmt: skip
    from stabilitylab.kernels import sigmoid_attention

    return sigmoid_attention(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, bias=sigmoid_bias, causal=causal,
        key_bias_BT=key_bias_BT, key_bias_BHT=key_bias_BHT, return_max_logit=return_max_logit,
        gate_BT=gate_BT, gate_BHT=gate_BHT,
    )  # fmt: skip


@register("sigmoid-triton-exact")
def sigmoid_triton_exact(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False, gate_BT=None, gate_BHT=None,
):  # fmt: skip
    """``sigmoid-triton`` with the exact sigmoid ``1 / (1 + exp(-x))`` in place of the fast
    ``tanh.approx.f32`` one: to check that the approximation does not change a run's fate."""
    from stabilitylab.kernels import sigmoid_attention

    return sigmoid_attention(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, bias=sigmoid_bias, causal=causal,
        key_bias_BT=key_bias_BT, key_bias_BHT=key_bias_BHT, return_max_logit=return_max_logit,
        exact=True, gate_BT=gate_BT, gate_BHT=gate_BHT,
    )  # fmt: skip


# ---- softmax: the Triton kernel and SDPA's flash kernel ------------------------------------------


@register("softmax-triton")
def softmax_triton(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False,
):  # fmt: skip
    from stabilitylab.kernels import softmax_attention

    return softmax_attention(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, causal=causal, key_bias_BT=key_bias_BT,
        key_bias_BHT=key_bias_BHT, return_max_logit=return_max_logit,
    )  # fmt: skip


@register("softmax-flash")
def softmax_flash(
    q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None, key_bias_BHT=None,
    sigmoid_bias=None, return_max_logit=False,
):  # fmt: skip
    """SDPA with the flash kernel alone (no fallback to another SDPA kernel)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if key_bias_BT is not None or key_bias_BHT is not None:
        raise ValueError(
            "attention backend 'softmax-flash' takes no key_bias_BT / key_bias_BHT (flash has no "
            "score bias); use 'softmax-triton'"
        )
    T = q_BHTD.shape[2]
    if not lengths_all_full(lengths_B, T):
        raise ValueError(
            f"attention backend 'softmax-flash' takes no padding (every lengths_B == T={T}): "
            "flash has no mask; use 'softmax-triton'"
        )
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, is_causal=causal)
    return out_BHTD, _stats(q_BHTD, k_BHTD, lengths_B, causal, return_max_logit)
