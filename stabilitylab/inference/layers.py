"""One block of the lab's decoder, run by the engine: the prefill through the model's own
training attention backend, and a decode step over a paged cache.

Conventions are the research loop's (``stabilitylab/eviction/decode.py``), which the engine is
tested against: QK-norm and RoPE through ``project_qkv_BHTD`` at absolute positions; the gate
the previous block emitted for a token, ``g`` (float32), enters this block's entry for it as
``log(g + 1e-8)`` on the logits and ``g v`` as the stored value, per ``gate_injection``; the
sigmoid bias ``b_b = -log(n_b)`` with ``n_b`` the window's input tokens (``S - 1``), or the
model's fixed ``sigmoid_bias``, for every query of the sequence, prefill included.

The prefill's backend takes one float sigmoid bias for the batch. When the sequences of a batch
have different ``n_b``, the per-sequence bias rides on the key bias instead (``b_b`` added to
every key of sequence b, the backend's bias 0): ``sigmoid(z + kb_j + b_b)`` either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stabilitylab.eviction.cache import LayerCache
from stabilitylab.eviction.decode import attention_weights_BHQN, project_qkv_BHTD
from stabilitylab.kernels.decode_attention import (
    add_scores_reference,
    decode_attention,
    decode_attention_reference,
)
from stabilitylab.kernels.reference import key_mask_BT, visible_BTT
from stabilitylab.model import gate_key_bias

SCORE_CHUNK_ELEMS = 1 << 24
"""H2O's prefill scores materialise at most this many weights at a time (query chunks)."""


def inject_gate(attn, v_BHTD: torch.Tensor, gate_BT: torch.Tensor | None):
    """``(v_BHTD, g_BHT, kb_BHT)``: the value scaled by the previous block's gate (values or
    both), the gate per entry (float32, what gate-tau reads) and its key bias (logits or both)."""
    if gate_BT is None:
        return v_BHTD, None, None
    g_BHT = gate_BT[:, None, :].expand(-1, attn.n_heads, -1)
    if attn.gate_injection in ("both", "values"):
        v_BHTD = v_BHTD * g_BHT[..., None].to(v_BHTD.dtype)
    kb_BHT = gate_key_bias(g_BHT) if attn.gate_injection in ("both", "logits") else None
    return v_BHTD, g_BHT, kb_BHT


# ---- prefill ----------------------------------------------------------------------------------


@dataclass
class Prefilled:
    """One block's prefill entries before any is dropped: ``(B, H, T, ...)``."""

    k_BHTD: torch.Tensor
    v_BHTD: torch.Tensor
    g_BHT: torch.Tensor | None
    kb_BHT: torch.Tensor | None
    score_BHT: torch.Tensor | None

    def as_cache(self, lengths_B: torch.Tensor) -> LayerCache:
        """A research ``LayerCache`` of these entries (padding rows dead, ``pos = -1``), for the
        research policies' ``drop_BHN``."""
        B, H, T, _ = self.k_BHTD.shape
        live_BT = key_mask_BT(lengths_B, T)
        pos_BT = torch.where(live_BT, torch.arange(T, device=live_BT.device), -1)
        return LayerCache(
            k_BHND=self.k_BHTD, v_BHND=self.v_BHTD, pos_BHN=pos_BT[:, None].expand(B, H, T),
            live_BHN=live_BT[:, None].expand(B, H, T), g_BHN=self.g_BHT,
            score_BHN=self.score_BHT,
        )  # fmt: skip


def backend_attention(attn, q_BHTD, k_BHTD, v_BHTD, lengths_B, kb_BHT, kind, bias_B):
    """The block's training backend, causal, over the prefill (module docstring: the bias)."""
    kb_BT = None if kb_BHT is None else kb_BHT[:, 0]
    sigmoid_bias = attn.sigmoid_bias
    if kind == "sigmoid":
        biases = bias_B.tolist()
        if len(set(biases)) == 1:
            sigmoid_bias = biases[0]
        else:
            # In at least float32 and the model's dtype: a float64 model's sum stays float64.
            dt = torch.promote_types(q_BHTD.dtype, torch.float32)
            b_BT = bias_B.to(dt)[:, None].expand(-1, q_BHTD.shape[2])
            kb_BT = b_BT if kb_BT is None else kb_BT.to(dt) + b_BT
            sigmoid_bias = 0.0
    kw = {} if kb_BT is None else {"key_bias_BT": kb_BT}
    out_BHTD, _ = attn.backend(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, causal=True, sigmoid_bias=sigmoid_bias, **kw
    )
    return out_BHTD


def prefill_scores_BHT(q_BHTD, k_BHTD, kb_BHT, lengths_B, kind, bias_B) -> torch.Tensor:
    """H2O's scores after the prefill: attention each key received from every valid query
    (causal), summed in the model's dtype, float64 out; the research loop's weights
    (``attention_weights_BHQN``), in query chunks."""
    B, H, T, _ = q_BHTD.shape
    visible_BTT_ = visible_BTT(lengths_B, T, causal=True)
    query_BT = key_mask_BT(lengths_B, T)
    b = None if bias_B is None else bias_B[:, None, None, None]
    total_BHT = torch.zeros(B, H, T, dtype=q_BHTD.dtype, device=q_BHTD.device)
    chunk = max(1, SCORE_CHUNK_ELEMS // max(1, B * H * T))
    for i in range(0, T, chunk):
        vis_BHQN = visible_BTT_[:, None, i : i + chunk].expand(B, H, -1, T)
        w_BHQN = attention_weights_BHQN(q_BHTD[:, :, i : i + chunk], k_BHTD, vis_BHQN, kb_BHT, kind, b)  # fmt: skip
        w_BHQN = w_BHQN * query_BT[:, None, i : i + chunk, None].to(w_BHQN.dtype)
        total_BHT = total_BHT + w_BHQN.sum(2)
    return total_BHT.to(torch.float64)


def prefill_block(block, x_BTC, at, lengths_B, gate_BT, kind, bias_B, need_scores):
    """``(x_BTC, Prefilled)``: the block over the prefill tokens, its entries captured."""
    attn = block.attn
    B, T, C = x_BTC.shape
    q_BHTD, k_BHTD, v_BHTD = project_qkv_BHTD(attn, block.ln1(x_BTC), at)
    v_BHTD, g_BHT, kb_BHT = inject_gate(attn, v_BHTD, gate_BT)
    out_BHTD = backend_attention(attn, q_BHTD, k_BHTD, v_BHTD, lengths_B, kb_BHT, kind, bias_B)
    score_BHT = None
    if need_scores:
        score_BHT = prefill_scores_BHT(q_BHTD, k_BHTD, kb_BHT, lengths_B, kind, bias_B)
    x_BTC = x_BTC + attn.proj(out_BHTD.transpose(1, 2).reshape(B, T, C))
    x_BTC = x_BTC + block.ff(block.ln2(x_BTC))
    return x_BTC, Prefilled(k_BHTD, v_BHTD, g_BHT, kb_BHT, score_BHT)


# ---- decode -----------------------------------------------------------------------------------


def paged_attention(cache, q_BHD, kind: str, bias_B, impl: str) -> torch.Tensor:
    """``out_BHD`` of each row's query over its live entries (``cache.count_BH``), the weights
    added to ``cache.score_PS`` when it tracks scores. ``impl``: triton (the kernel; CUDA, or
    the CPU interpreter) or reference (PyTorch, any dtype)."""
    b = bias_B if kind == "sigmoid" else None
    if impl == "triton":
        return decode_attention(
            q_BHD, cache.k_PSD, cache.v_PSD, cache.table_BHM, cache.count_BH, kind=kind,
            sigmoid_bias=b, key_bias_PS=cache.kb_PS, score_PS=cache.score_PS, check_counts=False,
        )  # fmt: skip
    out_BHD, w_BHN, slot_BHN = decode_attention_reference(
        q_BHD, cache.k_PSD, cache.v_PSD, cache.table_BHM, cache.count_BH, kind=kind,
        sigmoid_bias_B=b, key_bias_PS=cache.kb_PS,
    )  # fmt: skip
    if cache.score_PS is not None:
        add_scores_reference(cache.score_PS, w_BHN, slot_BHN, cache.count_BH)
    return out_BHD


@dataclass
class StepInputs:
    """What every block of one decode step shares (static tensors under a CUDA graph)."""

    pos_B: torch.Tensor
    active_BH: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor] | None
    """``(cos_B11D, sin_B11D)`` of each sequence's position, or None (no RoPE)."""


class _At:
    """The ``Positions`` face ``project_qkv_BHTD`` reads: per-sequence RoPE rows."""

    def __init__(self, rope):
        self.rope_TD = rope


def decode_block(block, x_B1C, gate_B1, cache, step: StepInputs, kind, bias_B, impl):
    """One block over one new token per sequence: write its entry (counted live), attend over
    the live ones and it, FFN. Returns ``(x_B1C, g_BH)``: the new entry's gate per row (None
    for an ungated layer). Gate-tau's drop of the entry (``g < tau``) is the caller's, once
    for every layer at the end of the step (``DecodeEngine._static_step``): nothing in the
    step reads this layer's count after its attention."""
    attn = block.attn
    B, _, C = x_B1C.shape
    q_BHTD, k_BHTD, v_BHTD = project_qkv_BHTD(attn, block.ln1(x_B1C), _At(step.rope))
    v_BHTD, g_BHT, kb_BHT = inject_gate(attn, v_BHTD, gate_B1)
    kb_BH = None if kb_BHT is None else kb_BHT[..., 0]
    cache.append(k_BHTD[:, :, 0], v_BHTD[:, :, 0], kb_BH, step.pos_B, step.active_BH,
                 fused=impl == "triton")  # fmt: skip
    out_BHD = paged_attention(cache, q_BHTD[:, :, 0], kind, bias_B, impl)
    x_B1C = x_B1C + attn.proj(out_BHD.reshape(B, 1, C))
    g_BH = None if g_BHT is None else g_BHT[..., 0]
    return x_B1C + block.ff(block.ln2(x_B1C)), g_BH
