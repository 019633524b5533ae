"""One pre-LN Transformer for both studies; attention chosen by name.

- ``causal=False``: the bidirectional encoder of the stress study, a masked-token head (MLM on
  cells; position embeddings index the rank of a gene within its cell).
- ``causal=True``: a GPT-2-style decoder, next-token head tied to the token embedding.

Knobs (``ModelConfig``): ``position`` learned | rope | none (NoPE); ``qk_norm`` none | layernorm |
rmsnorm, per head, before RoPE; ``gates``: KV-eviction gates (below).

Shapes: ``tokens_BT`` (long, right-padded with 0), ``lengths_B`` (valid tokens per row).

Gates (the KV-eviction study; form inferred from the paper's words, docs say so): block ``l < L-1``
reads its own output stream ``h_BTC`` and emits ``g_BT = sigmoid(h . w_l + b_l)`` (``g_BHT`` with
``gate_per_head``), ``w = 0`` and ``b = gate_bias_init`` at init. Block ``l + 1`` adds
``log(g_j + 1e-8)`` to every logit of key ``j`` (passed to the backend as ``key_bias_BT`` /
``key_bias_BHT``) and scales ``v_j`` by ``g_j`` before the backend (``gate_injection`` picks one or
both). After each forward, ``model.gates`` holds the gates it emitted: ``gates[l]`` is layer
``l``'s gate (read by layer ``l + 1``), float32, still in the autograd graph (the budget loss
differentiates through it); ``[]`` without gates. ``budget_loss`` and ``gate_mean`` reduce it.

Attention statistics: set ``model.record_max_logit = True`` before a forward pass and each
``SelfAttention`` leaves its exact per-head max |logit| in ``.max_logit_BH`` (detached, float32).
The backend computes it (fused in the Triton kernel, chunked elsewhere); when the flag is off
nothing extra runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from stabilitylab.attention import GATE_IN_KERNEL, get_backend
from stabilitylab.config import N_SPECIAL_TOKENS, ModelConfig
from stabilitylab.kernels.reference import key_mask_BT

GATE_EPS = 1e-8  # log(g + eps) on the logits: the paper's epsilon


# ---- pure maths -------------------------------------------------------------------------------


def rope_cos_sin(T: int, head_dim: int, base: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_TD, sin_TD)`` of RoPE (rotate-half layout: pair p is dims p and p + D/2), float32.
    Computed per call (T x D/2 angles): no buffer to keep in step with the context length."""
    inv_freq_P = base ** (
        -torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    angle_TP = torch.arange(T, device=device, dtype=torch.float32)[:, None] * inv_freq_P[None, :]
    angle_TD = torch.cat([angle_TP, angle_TP], dim=-1)
    return angle_TD.cos(), angle_TD.sin()


def apply_rope(x_BHTD: torch.Tensor, cos_TD: torch.Tensor, sin_TD: torch.Tensor) -> torch.Tensor:
    """Rotate each pair ``(x_p, x_{p+D/2})`` of position t by angle_tp; float32 inside, the
    input's dtype out. Then ``rope(q)_i . rope(k)_j`` depends on positions only through i - j."""
    x1, x2 = x_BHTD.float().chunk(2, dim=-1)
    rotated_BHTD = torch.cat([-x2, x1], dim=-1)
    return (x_BHTD.float() * cos_TD + rotated_BHTD * sin_TD).to(x_BHTD.dtype)


class _SplitQKV(torch.autograd.Function):
    """``split_qkv_heads``: views forward; the backward writes the three gradients into one
    ``(B, T, 3, H, D)`` buffer in a single pass. Autograd's own backward of ``view -> permute ->
    unbind`` stacks them ``(3, B, H, T, D)`` and then copies that into the projection's layout:
    two passes over 3 x B x T x C values."""

    @staticmethod
    def forward(ctx, qkv_BTX, n_heads: int):
        B, T, X = qkv_BTX.shape
        qkv_BT3HD = qkv_BTX.view(B, T, 3, n_heads, X // (3 * n_heads))
        return qkv_BT3HD.permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, dq_BHTD, dk_BHTD, dv_BHTD):
        grads = [dq_BHTD, dk_BHTD, dv_BHTD]
        like = next(g for g in grads if g is not None)
        grads = [torch.zeros_like(like) if g is None else g for g in grads]
        d_BT3HD = torch.stack([g.transpose(1, 2) for g in grads], dim=2)
        return d_BT3HD.flatten(2), None


def split_qkv_heads(qkv_BTX: torch.Tensor, n_heads: int, one_pass_grad: bool = False):
    """``(q_BHTD, k_BHTD, v_BHTD)``: views of the fused projection ``qkv_BTX`` (X = 3 H D, q then
    k then v, heads within each). ``one_pass_grad``: the same values, with a backward that
    assembles the gradient in one pass (``_SplitQKV``) instead of autograd's two."""
    if one_pass_grad:
        return _SplitQKV.apply(qkv_BTX, n_heads)
    B, T, X = qkv_BTX.shape
    qkv_BT3HD = qkv_BTX.view(B, T, 3, n_heads, X // (3 * n_heads))
    return qkv_BT3HD.permute(2, 0, 3, 1, 4).unbind(0)


def gate_key_bias(g: torch.Tensor) -> torch.Tensor:
    """The logit term of a gate: ``log(g + 1e-8)`` (0 at g = 1, about -18.4 at g = 0)."""
    return torch.log(g + GATE_EPS)


def padded_size(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (>= 1)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-n // multiple) * multiple


def head_linear(
    h_NC: torch.Tensor,
    weight_VC: torch.Tensor,
    bias_V: torch.Tensor | None,
    row_multiple: int = 1,
) -> torch.Tensor:
    """``F.linear(h_NC, weight_VC, bias_V)``, its GEMM run on the weight's rows zero-padded to a
    multiple of ``row_multiple``, the padded columns sliced off the logits: the same function and
    gradients (the pad is no parameter and its columns reach nothing, so the weight's gradient is
    that of its V real rows).

    Why: with V = 44,003 (44,000 genes + 3 special tokens) the logits' leading dimension is odd
    and cuBLAS falls back to alignment-1 kernels (sm75 ``s1688gemm ... align1`` on an H200, most
    of the step's GEMM time); padded to 64 it takes the Hopper kernels. Costs a copy of the weight
    and, in the backward, of the logits' gradient."""
    V = weight_VC.shape[0]
    pad = padded_size(V, row_multiple) - V
    if pad == 0:
        return F.linear(h_NC, weight_VC, bias_V)
    weight_PC = F.pad(weight_VC, (0, 0, 0, pad))
    bias_P = None if bias_V is None else F.pad(bias_V, (0, pad))
    return F.linear(h_NC, weight_PC, bias_P)[..., :V]


# ---- modules ----------------------------------------------------------------------------------


HEAD_ROW_MULTIPLE = 64
"""The head's rows padded to this multiple where speed is asked for (44,003 -> 44,032): the fast
step (``train.fast``) and the ``pad-vocab`` lever."""


class Head(nn.Linear):
    """The output head: an ``nn.Linear`` (same parameters, same state dict) whose GEMM runs on
    rows padded to ``row_multiple`` (``head_linear``; 1 = no padding). A speed setting, not part
    of the model: checkpoints do not carry it and load either way."""

    row_multiple: int = 1

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return head_linear(h, self.weight, self.bias, self.row_multiple)


def _qk_norm(cfg: ModelConfig) -> nn.Module | None:
    kind = cfg.qk_norm_kind
    if kind == "layernorm":
        return nn.LayerNorm(cfg.head_dim, eps=cfg.ln_eps)
    if kind == "rmsnorm":
        return nn.RMSNorm(cfg.head_dim, eps=cfg.ln_eps)
    return None


class TokenGate(nn.Module):
    """``h_BTC -> g_BT`` (or ``g_BHT`` per head): ``sigmoid(h . w + b)`` in float32.

    Built without drawing random numbers (w = 0, b = a constant), so a gated and a dense model
    made from the same seed share every other initial weight."""

    def __init__(self, d_model: int, n_gates: int, bias_init: float, per_head: bool):
        super().__init__()
        self.per_head = per_head
        self.bias_init = bias_init
        self.weight_GC = nn.Parameter(torch.zeros(n_gates, d_model))
        self.bias_G = nn.Parameter(torch.full((n_gates,), float(bias_init)))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight_GC)
        nn.init.constant_(self.bias_G, self.bias_init)

    def forward(self, h_BTC: torch.Tensor) -> torch.Tensor:
        # float32 even under autocast: at b = 5 a bf16 logit moves in steps of 1/32.
        with torch.autocast(h_BTC.device.type, enabled=False):
            g_BTG = torch.sigmoid(F.linear(h_BTC.float(), self.weight_GC, self.bias_G))
        return g_BTG.permute(0, 2, 1) if self.per_head else g_BTG[..., 0]


class SelfAttention(nn.Module):
    """``x_BTC -> y_BTC``: QKV projection, optional QK-norm, RoPE, the previous layer's gate,
    backend, output projection. ``layer(x_BTC, lengths_B)`` alone runs it ungated."""

    def __init__(self, cfg: ModelConfig, backend: str):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.q_norm, self.k_norm = _qk_norm(cfg), _qk_norm(cfg)
        self.causal = cfg.causal
        self.rope_base = cfg.rope_base if cfg.position == "rope" else None
        self.gate_injection = cfg.gate_injection
        self.gate_in_kernel = (
            cfg.gate_in_kernel and cfg.gate_injection == "both" and backend in GATE_IN_KERNEL
        )
        self.sigmoid_bias = cfg.sigmoid_bias
        self.backend_name = backend
        self.backend = get_backend(backend)
        self.record_max_logit = False
        self.max_logit_BH: torch.Tensor | None = None
        self.one_pass_qkv_grad = False  # a speed lever (split_qkv_heads); same values

    def _qkv(self, x_BTC: torch.Tensor):
        B, T, C = x_BTC.shape
        q_BHTD, k_BHTD, v_BHTD = split_qkv_heads(
            self.qkv(x_BTC), self.n_heads, self.one_pass_qkv_grad
        )
        if isinstance(self.q_norm, nn.RMSNorm):
            # In float32 (the fused kernel wants input and gain in one dtype), then back to the
            # projection's dtype: under autocast attention runs in bf16.
            dtype = v_BHTD.dtype
            q_BHTD = self.q_norm(q_BHTD.float()).to(dtype)
            k_BHTD = self.k_norm(k_BHTD.float()).to(dtype)
        elif self.q_norm is not None:
            # LayerNorm returns float32 under CUDA autocast and v follows: the stress study's
            # QK-LayerNorm runs always ran attention so.
            q_BHTD, k_BHTD = self.q_norm(q_BHTD), self.k_norm(k_BHTD)
            k_BHTD, v_BHTD = k_BHTD.to(q_BHTD.dtype), v_BHTD.to(q_BHTD.dtype)
        if self.rope_base is not None:
            cos_TD, sin_TD = rope_cos_sin(T, self.head_dim, self.rope_base, x_BTC.device)
            q_BHTD, k_BHTD = apply_rope(q_BHTD, cos_TD, sin_TD), apply_rope(k_BHTD, cos_TD, sin_TD)
        return q_BHTD, k_BHTD, v_BHTD

    def _inject(self, v_BHTD: torch.Tensor, gate: torch.Tensor | None):
        """The previous layer's gate: ``(v_BHTD scaled, backend kwargs with the key bias)``, or
        with ``gate_in_kernel`` ``(v_BHTD, the gate itself)`` for the kernel to apply both."""
        if gate is None:
            return v_BHTD, {}
        if self.gate_in_kernel:
            return v_BHTD, {("gate_BHT" if gate.dim() == 3 else "gate_BT"): gate}
        g_BHT = gate if gate.dim() == 3 else gate[:, None, :]
        if self.gate_injection in ("both", "values"):
            v_BHTD = v_BHTD * g_BHT[..., None].to(v_BHTD.dtype)
        if self.gate_injection == "values":
            return v_BHTD, {}
        key = "key_bias_BHT" if gate.dim() == 3 else "key_bias_BT"
        return v_BHTD, {key: gate_key_bias(gate)}

    def forward(
        self, x_BTC: torch.Tensor, lengths_B: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, C = x_BTC.shape
        q_BHTD, k_BHTD, v_BHTD = self._qkv(x_BTC)
        v_BHTD, bias_kwargs = self._inject(v_BHTD, gate)
        out_BHTD, max_logit_BH = self.backend(
            q_BHTD,
            k_BHTD,
            v_BHTD,
            lengths_B,
            causal=self.causal,
            sigmoid_bias=self.sigmoid_bias,
            return_max_logit=self.record_max_logit,
            **bias_kwargs,
        )
        self.max_logit_BH = max_logit_BH
        return self.proj(out_BHTD.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-LN block; ``gate_out`` (layers < L-1 of a gated model) emits this layer's gate."""

    def __init__(self, cfg: ModelConfig, backend: str, emits_gate: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = SelfAttention(cfg, backend)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.gate_out = None
        if emits_gate:
            n_gates = cfg.n_heads if cfg.gate_per_head else 1
            self.gate_out = TokenGate(cfg.d_model, n_gates, cfg.gate_bias_init, cfg.gate_per_head)

    def forward(
        self, x_BTC: torch.Tensor, lengths_B: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor:
        x_BTC = x_BTC + self.drop(self.attn(self.ln1(x_BTC), lengths_B, gate))
        return x_BTC + self.drop(self.ff(self.ln2(x_BTC)))


class Transformer(nn.Module):
    """Encoder (masked-token head) or causal decoder (tied next-token head), per ``cfg.causal``.

    ``forward(tokens_BT, lengths_B) -> logits_BTV``; ``self.gates`` then holds the gates that
    forward emitted (module docstring).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, context_len: int, backend: str):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(context_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        L = cfg.n_layers
        self.blocks = nn.ModuleList(
            Block(cfg, backend, emits_gate=cfg.gates and i < L - 1) for i in range(L)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        # GPT-2 ties the decoder's output projection to the token embedding (no bias).
        self.head = Head(cfg.d_model, vocab_size, bias=not cfg.causal)
        if cfg.causal:
            self.head.weight = self.tok_emb.weight
        self.gates: list[torch.Tensor] = []
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std * self.cfg.init_scale
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (nn.RMSNorm, TokenGate)):
                m.reset_parameters()

    @property
    def attention_layers(self) -> list[SelfAttention]:
        return [b.attn for b in self.blocks]

    def set_record_max_logit(self, on: bool) -> None:
        for a in self.attention_layers:
            a.record_max_logit = on
            if not on:
                a.max_logit_BH = None

    def set_one_pass_qkv_grad(self, on: bool) -> None:
        """The q/k/v gradient assembled in one pass (``split_qkv_heads``); the same values."""
        for a in self.attention_layers:
            a.one_pass_qkv_grad = on

    def set_head_row_multiple(self, multiple: int) -> None:
        """The head's GEMM on rows padded to ``multiple`` (``head_linear``): the same function,
        faster when the vocabulary is no multiple of 8. 1 turns it off."""
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"head row multiple must be an int >= 1, got {multiple!r}")
        self.head.row_multiple = multiple

    def forward(
        self, tokens_BT: torch.Tensor, lengths_B: torch.Tensor, return_hidden: bool = False
    ) -> torch.Tensor:
        """Returns logits over the vocabulary, ``logits_BTV``; sets ``self.gates``.
        ``return_hidden``: the final norm's output ``h_BTC`` instead, for a loss that applies
        ``self.head`` itself (``stabilitylab.chunked_loss``)."""
        x_BTC = self.tok_emb(tokens_BT)
        if self.pos_emb is not None:
            x_BTC = (
                x_BTC + self.pos_emb(torch.arange(tokens_BT.shape[1], device=x_BTC.device))[None]
            )
        x_BTC = self.drop(x_BTC)
        gates, gate = [], None
        for block in self.blocks:
            x_BTC = block(x_BTC, lengths_B, gate)
            gate = block.gate_out(x_BTC) if block.gate_out is not None else None
            if gate is not None:
                gates.append(gate)
        self.gates = gates
        h_BTC = self.ln_f(x_BTC)
        return h_BTC if return_hidden else self.head(h_BTC)


# ---- losses and accounting --------------------------------------------------------------------


@contextlib.contextmanager
def inference(model: nn.Module) -> Iterator[None]:
    """Eval mode and no gradients inside; the training flag is put back after (the probes and
    the decode loop read trained models this way)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def masked_lm_loss_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over masked positions (labels != -100), in float32."""
    return F.cross_entropy(
        logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=-100, reduction="sum"
    )


def next_token_labels_BT(tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the logits: ``labels[b, t] = tokens[b, t + 1]`` for ``t + 1 < L_b``,
    else -100 (the last valid token and padding predict nothing)."""
    T = tokens_BT.shape[1]
    labels_BT = torch.full_like(tokens_BT, -100)
    labels_BT[:, :-1] = tokens_BT[:, 1:]
    has_next_BT = torch.arange(T, device=tokens_BT.device)[None, :] + 1 < lengths_B[:, None]
    return labels_BT.masked_fill(~has_next_BT, -100)


def next_token_loss_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy, float32. ``labels_BT`` is aligned with the logits
    (``next_token_labels_BT``: position t's target is token t + 1; -100 = none)."""
    return masked_lm_loss_sum(logits_BTV, labels_BT)


def gate_mean(gates: Sequence[torch.Tensor], lengths_B: torch.Tensor) -> torch.Tensor:
    """Mean gate over gated layers, heads (per-head gates), batch and valid positions (j < L_b):
    every position a key can occupy, the last one included. Every layer has the same count, so
    this is also the mean of the per-layer means. 0 when there are no gates."""
    if len(gates) == 0:
        return torch.zeros((), device=lengths_B.device)
    valid_BT = key_mask_BT(lengths_B, gates[0].shape[-1])
    per_layer = []
    for g in gates:
        g_BHT = g if g.dim() == 3 else g[:, None, :]
        per_layer.append((g_BHT * valid_BT[:, None, :]).sum() / (valid_BT.sum() * g_BHT.shape[1]))
    return torch.stack(per_layer).mean()


def budget_loss(
    gates: Sequence[torch.Tensor],
    lengths_B: torch.Tensor,
    budget_lambda: float,
    norm: str = "mean",
    ref_layers: int = 12,
) -> torch.Tensor:
    """The budget term added to the mean CE, over the ``G = len(gates)`` gate layers with
    per-layer means ``m_l`` (``gate_mean``'s):

    - ``mean`` (the paper's literal form): ``lambda * sum_l m_l / G``, one layer pulled by
      ``lambda / G``;
    - ``per_gate``: ``lambda * sum_l m_l / (ref_layers - 1)``, one layer pulled by
      ``lambda / (ref_layers - 1)`` whatever ``G``; equal to ``mean`` when ``G = ref_layers - 1``.

    Under gradient accumulation weight each micro-batch by its share of the valid tokens."""
    if norm not in ("mean", "per_gate"):
        raise ValueError(f"budget norm must be 'mean' or 'per_gate', got {norm!r}")
    term = budget_lambda * gate_mean(gates, lengths_B)
    return term * (len(gates) / (ref_layers - 1)) if norm == "per_gate" else term


def vocab_size_for(n_genes: int) -> int:
    return n_genes + N_SPECIAL_TOKENS


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def dense_parameter_count(model: Transformer) -> int:
    """Parameters that cost a matmul per token: all but the position vectors and, when the head is
    not tied to it, the token embedding (a lookup). A tied embedding counts once, as the head."""
    n = count_parameters(model)
    if model.pos_emb is not None:
        n -= model.pos_emb.weight.numel()
    if model.head.weight is not model.tok_emb.weight:
        n -= model.tok_emb.weight.numel()
    return n


def head_parameter_count(model: Transformer) -> int:
    """Parameters of the output head (weight and bias; a tied weight counted here): the head's
    GEMMs cost 6 x this per row they run on."""
    bias = model.head.bias
    return model.head.weight.numel() + (bias.numel() if bias is not None else 0)


def flops_per_step(cfg: ModelConfig, n_params_dense: int, lengths: list[int]) -> float:
    """Training FLOPs for one batch: 6 x dense params x tokens + attention 12 x L x d x pairs.

    Counts valid tokens only (padding is work a padding-aware kernel skips); ``pairs`` is the
    visible (query, key) pairs: ``n^2`` per sequence, ``n (n + 1) / 2`` for a causal model.
    """
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) // 2 if cfg.causal else n * n for n in lengths)
    return 6.0 * n_params_dense * tokens + 12.0 * cfg.n_layers * cfg.d_model * pairs


def flops_per_step_labelled(
    cfg: ModelConfig, n_params_dense: int, n_params_head: int, lengths: list[int], n_labelled: int
) -> float:
    """``flops_per_step`` with the head's ``6 x n_params_head`` per row counted on the
    ``n_labelled`` rows that carry a label only: the work the loss needs (a loss that skips the
    unlabelled rows, ``stabilitylab.chunked_loss``, does only this; the masked-token task labels
    15%). ``n_params_head`` must be part of ``n_params_dense`` (``head_parameter_count``)."""
    if not 0 <= n_params_head <= n_params_dense:
        raise ValueError(f"n_params_head {n_params_head} must lie in [0, {n_params_dense}]")
    body = flops_per_step(cfg, n_params_dense - n_params_head, lengths)
    return body + 6.0 * n_params_head * n_labelled
