"""The research loop's gate-threshold decode in one masked forward pass per window batch.

A gate's eviction decision depends only on the gate of the entry's own token, ``g_j^(l) < tau``,
and that gate is causal (computed from token ``j``'s stream at layer ``l``). So the decode loop's
whole history under ``GateThreshold(tau)`` (or ``NoEviction``) is one forward pass over the
``S - 1`` input tokens in which layer ``l + 1``'s query ``i`` sees key ``j`` when

    j <= i  and  ( i < P                   the prefill attends before anything is evicted
                 or j == i                 a step's query sees its own new entry first
                 or g_j^(l) >= tau )       the entry survived its eviction

(layer 0, which no gate precedes, and a dense model see every ``j <= i``). The logits of the
positions ``P .. S - 2`` score tokens ``P + 1 .. S - 1``, as the loop's decode steps do. The
attention maths is the loop's (``decode.attention_weights_BHQN``: the gate's ``log(g + 1e-8)`` on
the logits, ``g v`` as the value, ``b = -log(S - 1)`` for sigmoid), so in float64 the two agree
to rounding (tests/test_eviction_masked.py); it runs as a handful of batched matmuls instead of
``W`` steps of ``L`` layers each, which is what lets a study sweep tau over whole splits.

The counts follow from the keep mask ``kept_j = g_j >= tau``: after the prefill a gated layer
holds ``H * #{j < P : kept_j}`` entries, after decode step ``t`` it holds ``H * #{j <= t : kept_j}``,
and step ``t``'s query reads ``H * (#{j < t : kept_j} + 1)``. Budgeted policies (H2O, KeyDiff)
decide from the attention history and still run through the loop.
"""

from __future__ import annotations

import torch

from stabilitylab.eviction.decode import (
    DecodeOutput,
    Positions,
    attention_weights_BHQN,
    check_decode_args,
    check_decoder,
    embed_BTC,
    project_qkv_BHTD,
    step_context,
)
from stabilitylab.eviction.policies import CachePolicy, GateThreshold, NoEviction
from stabilitylab.model import Transformer, gate_key_bias, inference

NLL_CHUNK_ELEMENTS = 1 << 26
"""Logit elements per chunk of the scoring (rows x vocabulary; 512 MB in float64)."""


def supports(policy: CachePolicy) -> bool:
    """The policies whose history this pass reproduces: no eviction and the gate threshold."""
    return isinstance(policy, (NoEviction, GateThreshold))


def visible_BTT(kept_BT: torch.Tensor, prefill: int) -> torch.Tensor:
    """``[b, i, j]``: key ``j`` visible to query ``i`` in a layer whose entries survive where
    ``kept_BT`` (module docstring)."""
    B, T = kept_BT.shape
    device = kept_BT.device
    causal_TT = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    own_or_prefill_TT = torch.eye(T, dtype=torch.bool, device=device)
    own_or_prefill_TT[:prefill] = True
    return causal_TT & (own_or_prefill_TT | kept_BT[:, None, :].expand(B, T, T))


def counts_from_kept(kept_BT: torch.Tensor, prefill: int, n_heads: int):
    """``(live_BS, read_B)`` of one layer from its keep mask: live entries after the prefill
    (index 0) and after each decode step (``1 + w``), and the entries the decode steps read."""
    held_BT = kept_BT.long().cumsum(1)  # held_BT[:, t] = #{j <= t : kept_j}
    live_BS = held_BT[:, prefill - 1 :] * n_heads
    before_BW = held_BT[:, prefill - 1 : -1]  # #{j < t : kept_j} for t = P .. S - 2
    read_B = ((before_BW + 1) * n_heads).sum(1)
    return live_BS, read_B


def _layer(block, x_BTC, at: Positions, gate_BT, kept_BT, prefill, kind, sigmoid_b):
    """One block over all positions with the keep mask of its cache (None: nothing evicted)."""
    attn = block.attn
    B, T, C = x_BTC.shape
    q_BHTD, k_BHTD, v_BHTD = project_qkv_BHTD(attn, block.ln1(x_BTC), at)
    key_bias_BHT = None
    if gate_BT is not None:
        g_BHT = gate_BT[:, None, :].expand(-1, attn.n_heads, -1)
        if attn.gate_injection in ("both", "values"):
            v_BHTD = v_BHTD * g_BHT[..., None].to(v_BHTD.dtype)
        if attn.gate_injection in ("both", "logits"):
            key_bias_BHT = gate_key_bias(g_BHT.to(torch.float32))
    if kept_BT is None:
        vis_BTT = torch.ones(T, T, dtype=torch.bool, device=x_BTC.device).tril().expand(B, T, T)
    else:
        vis_BTT = visible_BTT(kept_BT, prefill)
    w_BHTT = attention_weights_BHQN(q_BHTD, k_BHTD, vis_BTT[:, None], key_bias_BHT, kind, sigmoid_b)
    out_BHTD = torch.matmul(w_BHTT.to(v_BHTD.dtype), v_BHTD)
    x_BTC = x_BTC + attn.proj(out_BHTD.transpose(1, 2).reshape(B, T, C))
    return x_BTC + block.ff(block.ln2(x_BTC))


def scored_nll_BW(model: Transformer, x_BWC: torch.Tensor, targets_BW: torch.Tensor):
    """``-log p(target) = logsumexp(z) - z_target`` per scored position, in float64, the head
    applied in chunks of rows so that the logits never exceed ``NLL_CHUNK_ELEMENTS``. The
    log-sum-exp runs in the logits' own precision (at least float32: the loop's float64 softmax
    agrees to ~1e-7 relative on a float32 model, exactly on a float64 one) and no float64 copy of
    the logits is made: the full-vocabulary float64 softmax dominated a whole-split pass."""
    B, W, C = x_BWC.shape
    h_NC = model.ln_f(x_BWC.reshape(B * W, C))
    t_N = targets_BW.reshape(B * W)
    rows = max(1, NLL_CHUNK_ELEMENTS // model.tok_emb.num_embeddings)
    out = []
    for s in range(0, B * W, rows):
        z_NV = model.head(h_NC[s : s + rows])
        z_NV = z_NV.to(torch.promote_types(z_NV.dtype, torch.float32))
        lse_N = torch.logsumexp(z_NV, dim=-1)
        out.append((lse_N - z_NV.gather(1, t_N[s : s + rows, None])[:, 0]).double())
    return torch.cat(out).view(B, W)


def masked_decode_nll(
    model: Transformer, tokens_BS: torch.Tensor, prefill: int, policy: CachePolicy
) -> DecodeOutput:
    """``decode.decode_nll``'s output for ``NoEviction`` or ``GateThreshold`` from one masked
    pass (module docstring). ``caches`` is empty and ``kv_bytes_L`` counts the live entries'
    bytes (the loop's padded tensors hold the same at one sequence or equal counts)."""
    if not supports(policy):
        raise ValueError(f"{policy.name} decides from the attention history: use decode_nll")
    check_decoder(model)
    check_decode_args(model, tokens_BS, prefill, None)
    B, S = tokens_BS.shape
    T, H = S - 1, model.cfg.n_heads
    device = next(model.parameters()).device
    tokens_BS = tokens_BS.to(device)
    ctx = step_context(model, policy, T, None)
    tau = policy.tau if isinstance(policy, GateThreshold) else None
    with inference(model):
        at = Positions.of(model, 0, T, device)
        x_BTC, gate_BT = embed_BTC(model, tokens_BS[:, :T], at.pos_T), None
        live, read = [], []
        for layer, block in enumerate(model.blocks):
            kept_BT = None if (gate_BT is None or tau is None) else gate_BT >= tau
            x_BTC = _layer(
                block, x_BTC, at, gate_BT, kept_BT, prefill,
                ctx.kinds_L[layer], ctx.sigmoid_b_L[layer],
            )  # fmt: skip
            full_BT = torch.ones(B, T, dtype=torch.bool, device=device)
            live_BS, read_B = counts_from_kept(full_BT if kept_BT is None else kept_BT, prefill, H)
            live.append(live_BS)
            read.append(read_B)
            gate_BT = block.gate_out(x_BTC) if block.gate_out is not None else None
        nll_BW = scored_nll_BW(model, x_BTC[:, prefill:T], tokens_BS[:, prefill + 1 :])
    live_BSL = torch.stack(live, dim=2)
    bytes_per_entry = 2 * model.cfg.head_dim * next(model.parameters()).element_size()
    return DecodeOutput(
        nll_BW=nll_BW,
        written_per_layer=H * T,
        live_BL=live_BSL[:, -1],
        keys_read_BL=torch.stack(read, dim=1),
        live_BSL=live_BSL,
        kv_bytes_L=[int(v) * bytes_per_entry for v in live_BSL[:, -1].sum(0).tolist()],
        caches=[],
    )
