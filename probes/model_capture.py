"""What each attention layer of a trained ``Transformer`` sees, and running it on the probe maths.

Every ``SelfAttention`` calls its backend as ``backend(q, k, v, lengths_B, *, causal,
sigmoid_bias, return_max_logit, key_bias_BT | key_bias_BHT)`` with q and k after QK-norm and
RoPE and v already scaled by the previous layer's gate (``stabilitylab.model``). The context
managers here put a wrapper in place of ``attn.backend`` of every layer for the duration of a
``with`` block and always put the original back, also when the block raises:

- ``capture_attention(model)`` records each call (``AttentionInputs``) and then calls the
  original backend with the same arguments, so the model computes exactly what it computes
  without the probe (same logits, bit for bit);
- ``swapped_attention(model, run)`` replaces the computation: ``run(inputs)`` returns the
  layer's ``out_BHTD``. The support-removal probe runs the whole model on
  ``masked_attention_BHTD`` this way, with or without removed keys.

The attention kind comes from the backend's registered name (``softmax*`` or ``sigmoid*``).
A shared key bias ``key_bias_BT`` is stored as ``key_bias_BHT`` (expanded over heads), so one
code path serves shared and per-head gates; ``layer_attention_BHTD`` folds heads into the batch
to hand a per-head bias to the probe maths, which take one bias row per sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from stabilitylab.probes.masked_attention import attention_weights_BHTT, masked_attention_BHTD


@dataclass(frozen=True)
class AttentionInputs:
    """One backend call of one layer: its inputs as the backend received them, and its output
    (``out_BHTD``: the backend's, or the replacement's under ``swapped_attention``)."""

    layer: int
    q_BHTD: torch.Tensor
    k_BHTD: torch.Tensor
    v_BHTD: torch.Tensor
    lengths_B: torch.Tensor
    kind: str
    causal: bool
    sigmoid_bias: float | None
    key_bias_BHT: torch.Tensor | None
    out_BHTD: torch.Tensor | None = None


def attention_kind(backend_name: str) -> str:
    """``softmax`` or ``sigmoid`` from a registered backend name (``sigmoid-triton`` ->
    ``sigmoid``); any other name is refused, naming it."""
    for kind in ("softmax", "sigmoid"):
        if backend_name == kind or backend_name.startswith(kind + "-"):
            return kind
    raise ValueError(f"attention backend {backend_name!r} is neither softmax* nor sigmoid*")


def _key_bias_BHT(q_BHTD, key_bias_BT, key_bias_BHT) -> torch.Tensor | None:
    if key_bias_BT is not None and key_bias_BHT is not None:
        raise ValueError("a backend call passed both key_bias_BT and key_bias_BHT")
    if key_bias_BT is not None:
        B, H, T, _ = q_BHTD.shape
        return key_bias_BT[:, None, :].expand(B, H, T)
    return key_bias_BHT


def _layers(model) -> list:
    layers = getattr(model, "attention_layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention_layers to probe")
    return list(layers)


@contextmanager
def _wrapped_backends(model, make: Callable[[int, object, Callable], Callable]) -> Iterator[None]:
    """Every layer's ``attn.backend`` becomes ``make(layer, attn, original)`` inside the block;
    the originals come back in ``finally``."""
    layers = _layers(model)
    originals = [attn.backend for attn in layers]
    try:
        for i, attn in enumerate(layers):
            attn.backend = make(i, attn, originals[i])
        yield
    finally:
        for attn, original in zip(layers, originals, strict=True):
            attn.backend = original


def _recorder(records: list[AttentionInputs], run: Callable | None):
    """A ``make`` for ``_wrapped_backends``: record each call, then the original backend
    (``run`` None) or ``run(inputs)`` computes the output."""

    def make(layer: int, attn, original: Callable) -> Callable:
        kind = attention_kind(attn.backend_name)

        def backend(q_BHTD, k_BHTD, v_BHTD, lengths_B, *, causal=False, key_bias_BT=None,
                    key_bias_BHT=None, sigmoid_bias=None, return_max_logit=False):  # fmt: skip
            inputs = AttentionInputs(
                layer=layer, q_BHTD=q_BHTD, k_BHTD=k_BHTD, v_BHTD=v_BHTD, lengths_B=lengths_B,
                kind=kind, causal=causal, sigmoid_bias=sigmoid_bias,
                key_bias_BHT=_key_bias_BHT(q_BHTD, key_bias_BT, key_bias_BHT),
            )  # fmt: skip
            if run is None:
                out_BHTD, stats = original(
                    q_BHTD, k_BHTD, v_BHTD, lengths_B, causal=causal, key_bias_BT=key_bias_BT,
                    key_bias_BHT=key_bias_BHT, sigmoid_bias=sigmoid_bias,
                    return_max_logit=return_max_logit,
                )  # fmt: skip
                records.append(replace(inputs, out_BHTD=out_BHTD))
                return out_BHTD, stats
            # The record keeps the probe's precision; the model continues in its own dtype.
            out_BHTD = run(inputs)
            records.append(replace(inputs, out_BHTD=out_BHTD))
            return out_BHTD.to(v_BHTD.dtype), None

        return backend

    return make


@contextmanager
def capture_attention(model) -> Iterator[list[AttentionInputs]]:
    """Yields a list that each forward pass inside the block extends by one ``AttentionInputs``
    per layer, in call order; the model's own backends compute (nothing changes)."""
    records: list[AttentionInputs] = []
    with _wrapped_backends(model, _recorder(records, None)):
        yield records


@contextmanager
def swapped_attention(
    model, run: Callable[[AttentionInputs], torch.Tensor]
) -> Iterator[list[AttentionInputs]]:
    """As ``capture_attention``, but ``run(inputs) -> out_BHTD`` computes each layer's output
    in place of its backend (the max-logit statistic is then None)."""
    records: list[AttentionInputs] = []
    with _wrapped_backends(model, _recorder(records, run)):
        yield records


# ---- the probe maths on captured inputs -------------------------------------------------------


def probe_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 at least: a bf16 model's attention is probed in float32 (float64 stays)."""
    return torch.promote_types(dtype, torch.float32)


def _folded(inputs: AttentionInputs, dtype: torch.dtype | None, removed_BT: torch.Tensor | None):
    """``(q, k, v, lengths, key_bias, removed)`` with heads folded into the batch when the key
    bias is per head (``(B*H, 1, T, D)``), else as given; cast to ``dtype``."""
    dtype = dtype or probe_dtype(inputs.q_BHTD.dtype)
    q, k, v = (t.to(dtype) for t in (inputs.q_BHTD, inputs.k_BHTD, inputs.v_BHTD))
    lengths_B, bias = inputs.lengths_B, inputs.key_bias_BHT
    if bias is None:
        return q, k, v, lengths_B, None, removed_BT
    B, H, T, D = q.shape
    fold = [t.reshape(B * H, 1, T, t.shape[-1]) for t in (q, k, v)]
    removed = None if removed_BT is None else removed_BT.repeat_interleave(H, dim=0)
    return (*fold, lengths_B.repeat_interleave(H), bias.reshape(B * H, T).to(dtype), removed)


def layer_attention_BHTD(
    inputs: AttentionInputs,
    removed_BT: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The layer's attention output from the probe maths (``masked_attention_BHTD``), with the
    positions of ``removed_BT`` removed (logits masked, values zeroed) when given."""
    q, k, v, lengths, bias, removed = _folded(inputs, dtype, removed_BT)
    out = masked_attention_BHTD(
        q, k, v, lengths, kind=inputs.kind, causal=inputs.causal, key_bias_BT=bias,
        sigmoid_bias=inputs.sigmoid_bias, removed_BT=removed,
    )  # fmt: skip
    return out.reshape(inputs.v_BHTD.shape[:3] + out.shape[-1:])


def layer_weights_BHTT(inputs: AttentionInputs, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The layer's attention weights ``a_BHTT`` (``attention_weights_BHTT``), gate bias included."""
    q, k, _, lengths, bias, _ = _folded(inputs, dtype, None)
    a = attention_weights_BHTT(
        q, k, lengths, kind=inputs.kind, causal=inputs.causal, key_bias_BT=bias,
        sigmoid_bias=inputs.sigmoid_bias,
    )  # fmt: skip
    B, H, T, _ = inputs.q_BHTD.shape
    return a.reshape(B, H, T, T)
