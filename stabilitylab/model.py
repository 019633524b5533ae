"""A minimal pre-LN bidirectional encoder with a masked-token head; attention chosen by name.

Shapes: ``tokens_BT`` (long, right-padded with 0), ``lengths_B`` (valid tokens per row).
Position embeddings index the rank of a gene within its cell (rank-value encoding).

Attention statistics: set ``model.record_max_logit = True`` before a forward pass and each
``SelfAttention`` leaves its exact per-head max |logit| in ``.max_logit_BH`` (detached, float32).
The backend computes it (fused in the Triton kernel, chunked elsewhere); when the flag is off
nothing extra runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from stabilitylab.attention import get_backend
from stabilitylab.config import N_SPECIAL_TOKENS, ModelConfig


class SelfAttention(nn.Module):
    """``x_BTC -> y_BTC``: QKV projection, optional QK-LayerNorm, backend, output projection."""

    def __init__(self, cfg: ModelConfig, backend: str):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.q_norm = nn.LayerNorm(cfg.head_dim, eps=cfg.ln_eps) if cfg.qk_layernorm else None
        self.k_norm = nn.LayerNorm(cfg.head_dim, eps=cfg.ln_eps) if cfg.qk_layernorm else None
        self.sigmoid_bias = cfg.sigmoid_bias
        self.backend_name = backend
        self.backend = get_backend(backend)
        self.record_max_logit = False
        self.max_logit_BH: torch.Tensor | None = None

    def forward(self, x_BTC: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
        B, T, C = x_BTC.shape
        qkv_BT3HD = self.qkv(x_BTC).view(B, T, 3, self.n_heads, self.head_dim)
        q_BHTD, k_BHTD, v_BHTD = qkv_BT3HD.permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_norm is not None:
            q_BHTD, k_BHTD = self.q_norm(q_BHTD), self.k_norm(k_BHTD)
            v_BHTD = v_BHTD.to(q_BHTD.dtype)
        out_BHTD, max_logit_BH = self.backend(
            q_BHTD,
            k_BHTD,
            v_BHTD,
            lengths_B,
            sigmoid_bias=self.sigmoid_bias,
            return_max_logit=self.record_max_logit,
        )
        self.max_logit_BH = max_logit_BH
        return self.proj(out_BHTD.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: str):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.attn = SelfAttention(cfg, backend)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model)
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_BTC: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
        x_BTC = x_BTC + self.drop(self.attn(self.ln1(x_BTC), lengths_B))
        return x_BTC + self.drop(self.ff(self.ln2(x_BTC)))


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, context_len: int, backend: str):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(context_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, backend) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps)
        self.head = nn.Linear(cfg.d_model, vocab_size)
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

    @property
    def attention_layers(self) -> list[SelfAttention]:
        return [b.attn for b in self.blocks]

    def set_record_max_logit(self, on: bool) -> None:
        for a in self.attention_layers:
            a.record_max_logit = on
            if not on:
                a.max_logit_BH = None

    def forward(self, tokens_BT: torch.Tensor, lengths_B: torch.Tensor) -> torch.Tensor:
        """Returns logits over the vocabulary, ``logits_BTV``."""
        T = tokens_BT.shape[1]
        pos_T = torch.arange(T, device=tokens_BT.device)
        x_BTC = self.drop(self.tok_emb(tokens_BT) + self.pos_emb(pos_T)[None])
        for block in self.blocks:
            x_BTC = block(x_BTC, lengths_B)
        return self.head(self.ln_f(x_BTC))


def masked_lm_loss_sum(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over masked positions (labels != -100), in float32."""
    return F.cross_entropy(
        logits_BTV.float().flatten(0, 1), labels_BT.flatten(), ignore_index=-100, reduction="sum"
    )


def vocab_size_for(n_genes: int) -> int:
    return n_genes + N_SPECIAL_TOKENS


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_step(cfg: ModelConfig, n_params_dense: int, lengths: list[int]) -> float:
    """Training FLOPs for one batch: 6 x dense params x tokens + attention 12 x L x d x sum(len^2).

    Counts valid tokens only (padding is work a padding-aware kernel skips).
    """
    tokens = sum(lengths)
    attn = 12.0 * cfg.n_layers * cfg.d_model * sum(n * n for n in lengths)
    return 6.0 * n_params_dense * tokens + attn
