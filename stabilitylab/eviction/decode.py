"""Prefill + teacher-forced token-by-token decode through a trained decoder's own weights.

``decode_nll(model, tokens_BS, prefill, policy)`` takes ``B`` sequences of ``S = P + W + 1``
tokens. The prefill runs the ``P`` first tokens through every layer at once, writing their keys
and values into one ``LayerCache`` per layer; then tokens ``P .. P + W - 1`` go in one at a time,
each step reading only the live entries, and the step at position ``t`` scores token ``t + 1``.
After each layer attends (prefill and every step) the policy removes entries from that layer's
cache (``policies.py``). All ``B`` sequences move in lock step; they are independent.

The maths is the model's (``stabilitylab.model``), read from its modules rather than its forward:
embedding (+ learned position vector), per block ``ln1 -> qkv -> QK-norm (the model's dtype
handling) -> RoPE at the entry's absolute position -> gate injection -> attention -> proj -> FFN``,
then ``ln_f -> head``. Gate injection uses the gate the previous layer emitted for the entry's
token (``log(g + 1e-8)`` on its logits, ``g v`` stored as its value, per ``gate_injection``).
Attention, for a query at position ``i`` over the live entries ``j`` (all with ``pos_j <= i``):

    z_ij = q_i . k_j / sqrt(D) + log(g_j + 1e-8)
    softmax: a_ij = exp(z_ij) / sum_j' exp(z_ij')      sigmoid: a_ij = sigmoid(z_ij + b)

with ``b = -log(S - 1)`` when the model's ``sigmoid_bias`` is None: the full forward pass over
the ``S - 1`` input tokens uses ``-log(n_valid)`` for every row (``kernels/reference.py``), so the
decode uses that same constant, and at ``tau = 0`` (nothing evicted) it reproduces the full pass.

Limits: token-wise gates only (``gate_per_head=True`` is refused: the cache keeps the same count
of entries in every head of a row only when a token leaves all heads at once, which the
budgeted baselines also respect); no dropout (the model is put in eval mode for the call); the
maths runs in the model's parameter dtype, one layer at a time, without a fused kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from stabilitylab.eviction.cache import LayerCache
from stabilitylab.eviction.policies import CachePolicy, check_counts
from stabilitylab.kernels.reference import default_scale, sigmoid_bias_B
from stabilitylab.model import Transformer, apply_rope, gate_key_bias, inference, rope_cos_sin

KIND_OF_BACKEND_PREFIX = {"softmax": "softmax", "sigmoid": "sigmoid"}


# ---- checks -----------------------------------------------------------------------------------


def attention_kind(backend_name: str) -> str:
    """``softmax`` or ``sigmoid`` from a backend's registry name (``sigmoid-triton`` -> sigmoid)."""
    for prefix, kind in KIND_OF_BACKEND_PREFIX.items():
        if backend_name.startswith(prefix):
            return kind
    raise ValueError(f"attention backend {backend_name!r} is neither softmax nor sigmoid")


def check_decoder(model: nn.Module, source: str = "the model") -> Transformer:
    """Refuse what the decode loop cannot run, naming ``source`` (a checkpoint path, a run)."""
    if not isinstance(model, Transformer):
        raise ValueError(f"{source}: eviction needs a stabilitylab Transformer, got {type(model)}")
    cfg = model.cfg
    if not cfg.causal:
        raise ValueError(
            f"{source}: model.causal=False (an encoder of the masked-LM task); KV eviction needs "
            "a causal decoder (model.causal=True)"
        )
    if cfg.gate_per_head:
        raise ValueError(
            f"{source}: model.gate_per_head=True is not supported by the eviction cache; it "
            "evicts a token from all heads of a layer (token-wise gates)"
        )
    for a in model.attention_layers:
        attention_kind(a.backend_name)
    return model


def attention_kinds(model: Transformer) -> set[str]:
    return {attention_kind(a.backend_name) for a in model.attention_layers}


# ---- pure maths -------------------------------------------------------------------------------


def attention_weights_BHQN(
    q_BHQD: torch.Tensor,
    k_BHND: torch.Tensor,
    visible_BHQN: torch.Tensor,
    key_bias_BHN: torch.Tensor | None,
    kind: str,
    sigmoid_b: torch.Tensor | None,
) -> torch.Tensor:
    """Weights ``a_BHQN`` (module docstring); zero on invisible entries. Same order of operations
    as ``kernels/reference.py`` so that float64 agrees to rounding."""
    s_BHQN = torch.matmul(q_BHQD, k_BHND.transpose(-1, -2)) * default_scale(q_BHQD.shape[-1])
    if key_bias_BHN is not None:
        s_BHQN = s_BHQN + key_bias_BHN[:, :, None, :].to(s_BHQN.dtype)
    if kind == "softmax":
        return torch.softmax(s_BHQN.masked_fill(~visible_BHQN, float("-inf")), dim=-1)
    p_BHQN = torch.sigmoid(s_BHQN + sigmoid_b.to(s_BHQN.dtype))
    return p_BHQN * visible_BHQN.to(p_BHQN.dtype)


def visible_BHQN(cache: LayerCache, pos_Q: torch.Tensor) -> torch.Tensor:
    """Live entries at or before each query's position (causality inside the prefill)."""
    return cache.live_BHN[:, :, None, :] & (cache.pos_BHN[:, :, None, :] <= pos_Q[:, None])


@dataclass
class Positions:
    """Absolute positions of the new tokens and, under RoPE, their rows of the model's own
    cos/sin table (bit-identical angles to the full pass's), built once per step."""

    pos_T: torch.Tensor
    rope_TD: tuple[torch.Tensor, torch.Tensor] | None

    @classmethod
    def of(cls, model: Transformer, start: int, T: int, device) -> Positions:
        pos_T = torch.arange(start, start + T, device=device)
        cfg = model.cfg
        if cfg.position != "rope":
            return cls(pos_T, None)
        cos_TD, sin_TD = rope_cos_sin(start + T, cfg.head_dim, cfg.rope_base, device)
        return cls(pos_T, (cos_TD[start:], sin_TD[start:]))


# ---- one layer --------------------------------------------------------------------------------


def project_qkv_BHTD(attn: nn.Module, h_BTC: torch.Tensor, at: Positions):
    """``SelfAttention._qkv`` with explicit positions: projection, QK-norm, RoPE."""
    B, T, _ = h_BTC.shape
    qkv_BT3HD = attn.qkv(h_BTC).view(B, T, 3, attn.n_heads, attn.head_dim)
    q_BHTD, k_BHTD, v_BHTD = qkv_BT3HD.permute(2, 0, 3, 1, 4).unbind(0)
    if isinstance(attn.q_norm, nn.RMSNorm):
        q_BHTD = attn.q_norm(q_BHTD.float()).to(v_BHTD.dtype)
        k_BHTD = attn.k_norm(k_BHTD.float()).to(v_BHTD.dtype)
    elif attn.q_norm is not None:
        q_BHTD, k_BHTD = attn.q_norm(q_BHTD), attn.k_norm(k_BHTD)
        k_BHTD, v_BHTD = k_BHTD.to(q_BHTD.dtype), v_BHTD.to(q_BHTD.dtype)
    if attn.rope_base is not None:
        q_BHTD, k_BHTD = apply_rope(q_BHTD, *at.rope_TD), apply_rope(k_BHTD, *at.rope_TD)
    return q_BHTD, k_BHTD, v_BHTD


def write_entries(attn, cache: LayerCache, k_BHTD, v_BHTD, pos_T, gate_BT) -> None:
    """Append the new entries; the value is stored already scaled by the gate when the model
    injects into values (what its backend would read)."""
    g_BHT = None
    if gate_BT is not None:
        g_BHT = gate_BT[:, None, :].expand(-1, attn.n_heads, -1)
        if attn.gate_injection in ("both", "values"):
            v_BHTD = v_BHTD * g_BHT[..., None].to(v_BHTD.dtype)
    cache.append(k_BHTD, v_BHTD, pos_T, g_BHT)


def cached_attention(attn, q_BHTD, pos_T, cache: LayerCache, kind, sigmoid_b):
    """``(out_BHTD, weights_BHTN)`` of the queries over the cache's live entries."""
    key_bias_BHN = None
    if cache.g_BHN is not None and attn.gate_injection in ("both", "logits"):
        key_bias_BHN = gate_key_bias(cache.g_BHN)
    w_BHTN = attention_weights_BHQN(
        q_BHTD, cache.k_BHND, visible_BHQN(cache, pos_T), key_bias_BHN, kind, sigmoid_b
    )
    return torch.matmul(w_BHTN.to(cache.v_BHND.dtype), cache.v_BHND), w_BHTN


@dataclass
class StepContext:
    """What every layer of one decode call shares."""

    kinds_L: list[str]
    sigmoid_b_L: list[torch.Tensor | None]
    policy: CachePolicy
    keep_BSL: torch.Tensor | None
    """A budgeted policy's live entries per head after each step: index 0 the prefill, ``1 + w``
    decode step ``w`` (``keep_schedule_BSL``)."""
    step: int = 0
    """Index into ``keep_BSL`` of the step being run."""


def block_step(block, layer: int, x_BTC, at: Positions, cache: LayerCache, gate_BT, ctx):
    """One block over new tokens: write, attend, evict, FFN. Returns ``(x_BTC, keys read)``."""
    attn = block.attn
    B, T, C = x_BTC.shape
    q_BHTD, k_BHTD, v_BHTD = project_qkv_BHTD(attn, block.ln1(x_BTC), at)
    write_entries(attn, cache, k_BHTD, v_BHTD, at.pos_T, gate_BT)
    keys_read_B = cache.live_BHN.sum((1, 2))
    out_BHTD, w_BHTN = cached_attention(
        attn, q_BHTD, at.pos_T, cache, ctx.kinds_L[layer], ctx.sigmoid_b_L[layer]
    )
    cache.add_scores(w_BHTN)
    keep_B = None if ctx.keep_BSL is None else ctx.keep_BSL[:, ctx.step, layer]
    drop_BHN = ctx.policy.drop_BHN(cache, keep_B)
    if drop_BHN is not None:
        cache.compact(drop_BHN)
    x_BTC = x_BTC + attn.proj(out_BHTD.transpose(1, 2).reshape(B, T, C))
    return x_BTC + block.ff(block.ln2(x_BTC)), keys_read_B


# ---- the model --------------------------------------------------------------------------------


def embed_BTC(model: Transformer, tokens_BT: torch.Tensor, pos_T: torch.Tensor) -> torch.Tensor:
    x_BTC = model.tok_emb(tokens_BT)
    if model.pos_emb is not None:
        x_BTC = x_BTC + model.pos_emb(pos_T)[None]
    return x_BTC


def model_step(model, caches, tokens_BT, start: int, ctx: StepContext):
    """All blocks over the new tokens at positions ``start ..``: ``(final hidden x_BTC,
    keys_read_BL)``; each block's gate is stored with the entries the next block writes."""
    at = Positions.of(model, start, tokens_BT.shape[1], tokens_BT.device)
    x_BTC, gate_BT, keys_read = embed_BTC(model, tokens_BT, at.pos_T), None, []
    for layer, (block, cache) in enumerate(zip(model.blocks, caches, strict=True)):
        x_BTC, keys_read_B = block_step(block, layer, x_BTC, at, cache, gate_BT, ctx)
        keys_read.append(keys_read_B)
        gate_BT = block.gate_out(x_BTC) if block.gate_out is not None else None
    return x_BTC, torch.stack(keys_read, dim=1)


def token_nll_B(model, x_B1C: torch.Tensor, target_B: torch.Tensor) -> torch.Tensor:
    """``-log p(target)`` in float64 from the last hidden state (the model's ln_f and head)."""
    logits_BV = model.head(model.ln_f(x_B1C[:, -1]))
    logp_BV = torch.log_softmax(logits_BV.to(torch.float64), dim=-1)
    return -logp_BV.gather(1, target_B[:, None])[:, 0]


def new_caches(model: Transformer, B: int, policy: CachePolicy) -> list[LayerCache]:
    p = next(model.parameters())
    cfg = model.cfg
    return [
        LayerCache.empty(
            B, cfg.n_heads, cfg.head_dim, dtype=p.dtype, device=p.device,
            gated=layer > 0 and model.blocks[layer - 1].gate_out is not None,
            track_scores=policy.needs_scores,
        )
        for layer in range(cfg.n_layers)
    ]  # fmt: skip


def step_context(model: Transformer, policy: CachePolicy, n_inputs: int, keep_BSL) -> StepContext:
    if policy.needs_budget and keep_BSL is None:
        raise ValueError(f"policy {policy.name} keeps a budget: pass keep_BL (entries per head)")
    kinds_L = [attention_kind(a.backend_name) for a in model.attention_layers]
    device = next(model.parameters()).device
    n_B = torch.tensor([n_inputs], device=device)
    sigmoid_b_L = [sigmoid_bias_B(n_B, a.sigmoid_bias)[0] for a in model.attention_layers]
    return StepContext(kinds_L, sigmoid_b_L, policy, keep_BSL)


# ---- the decode call --------------------------------------------------------------------------


@dataclass
class DecodeOutput:
    """One batch of sequences. Entries count (token, head) rows of one layer's cache."""

    nll_BW: torch.Tensor
    """``-log p(token t + 1)`` of decode step ``t = P + w``, float64."""
    written_per_layer: int
    """Entries each sequence wrote into each layer's cache: ``n_heads * (P + W)``."""
    live_BL: torch.Tensor
    """Live entries per sequence and layer after the last step."""
    keys_read_BL: torch.Tensor
    """Entries the decode steps' queries read, summed over steps and heads."""
    live_BSL: torch.Tensor
    """Live entries (summed over heads) per sequence and layer after the prefill (index 0) and
    after each decode step's eviction (index ``1 + w``): what a step-matched baseline may hold."""
    kv_bytes_L: list[int]
    """Bytes of each layer's K and V tensors after the last step, the whole batch."""
    caches: list[LayerCache]
    """The caches after the last step (for inspection; drop the output to free them)."""


def keep_schedule_BSL(keep, B: int, n_steps: int, L: int) -> torch.Tensor:
    """A budget as a per-step schedule: ``keep`` of shape ``(B, L)`` (the same budget from the
    prefill on) or ``(B, n_steps, L)`` (index 0 after the prefill, ``1 + w`` after decode step
    ``w``) -> ``(B, n_steps, L)``."""
    shape = tuple(keep.shape)
    if shape == (B, L):
        return keep[:, None, :].expand(B, n_steps, L)
    if shape != (B, n_steps, L):
        raise ValueError(
            f"keep_BL must have shape {(B, L)} (one budget per sequence and layer) or "
            f"{(B, n_steps, L)} (one per step: the prefill, then each decode step), got {shape}"
        )
    return keep


def check_decode_args(model: Transformer, tokens_BS, prefill: int, keep_BL) -> None:
    B, S = tokens_BS.shape
    if not 1 <= prefill < S - 1:
        raise ValueError(
            f"prefill must be in [1, {S - 2}] for sequences of {S} tokens, got {prefill}"
        )
    if model.pos_emb is not None and S - 1 > model.pos_emb.num_embeddings:
        raise ValueError(
            f"{S - 1} input tokens exceed the model's learned positions "
            f"({model.pos_emb.num_embeddings})"
        )
    if keep_BL is None:
        return
    check_counts(keep_BL, "keep_BL")  # whole entries: the loop below casts to long
    keep_BSL = keep_schedule_BSL(keep_BL, B, S - prefill, model.cfg.n_layers)
    bad = (keep_BSL < 0) | (keep_BSL > S - 1)
    if bool(bad.any()):
        b, step, layer = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"baseline budget of {int(keep_BSL[b, step, layer])} entries per head (sequence {b}, "
            f"layer {layer}) "
            f"is outside [0, {S - 1}], the sequence's {S - 1} input tokens"
        )


def decode_nll(
    model: Transformer,
    tokens_BS: torch.Tensor,
    prefill: int,
    policy: CachePolicy,
    keep_BL: torch.Tensor | None = None,
) -> DecodeOutput:
    """Prefill ``tokens_BS[:, :prefill]``, then decode tokens ``prefill .. S - 2`` one at a time
    (teacher forcing), scoring tokens ``prefill + 1 .. S - 1``. ``keep_BL``: a budgeted
    policy's live entries per head for each sequence and layer, ``(B, L)`` from the prefill on or
    ``(B, W + 1, L)`` per step (``keep_schedule_BSL``)."""
    check_decoder(model)
    check_decode_args(model, tokens_BS, prefill, keep_BL)
    B, S = tokens_BS.shape
    device = next(model.parameters()).device
    tokens_BS = tokens_BS.to(device)
    keep_BSL = None
    if keep_BL is not None:
        keep = keep_BL.to(device=device, dtype=torch.long)
        keep_BSL = keep_schedule_BSL(keep, B, S - prefill, model.cfg.n_layers)
    ctx = step_context(model, policy, S - 1, keep_BSL)
    with inference(model):
        caches = new_caches(model, B, policy)
        model_step(model, caches, tokens_BS[:, :prefill], 0, ctx)
        nll, keys_read_BL, live = [], 0, [_live_BL(caches)]
        for t in range(prefill, S - 1):
            ctx.step = t - prefill + 1
            x_B1C, read_BL = model_step(model, caches, tokens_BS[:, t : t + 1], t, ctx)
            nll.append(token_nll_B(model, x_B1C, tokens_BS[:, t + 1]))
            keys_read_BL = keys_read_BL + read_BL
            live.append(_live_BL(caches))
    return DecodeOutput(
        nll_BW=torch.stack(nll, dim=1),
        written_per_layer=model.cfg.n_heads * (S - 1),
        live_BL=live[-1],
        keys_read_BL=keys_read_BL,
        live_BSL=torch.stack(live, dim=1),
        kv_bytes_L=[c.kv_bytes() for c in caches],
        caches=caches,
    )


def _live_BL(caches: list[LayerCache]) -> torch.Tensor:
    return torch.stack([c.live_count_BH().sum(-1) for c in caches], dim=1)
