"""Random support removal: how much an attention output moves when random K/V entries vanish.

The probe (paper, "random support removal"; confirmed in words unless marked)::

    eligible_b = {j : n_sinks <= j < L_b}            first four positions kept: attention sinks
    R_b        = m_b positions drawn uniformly without replacement from eligible_b,
                 m_b = floor(p * |eligible_b| + 1/2)  (round half up; the rounding is ours)
    O~         = attention with logits of R_b masked and values of R_b zeroed
    delta_b    = ||O~_b - O_b||_F / ||O_b||_F       over (heads, valid tokens, head dim)
                                                    (the norm's form is inferred)

One mask per sequence, shared by every head of the layer (the paper removes *positions*).
Padding is never removed: only valid positions are eligible. The softmax arm renormalises over
the keys that remain, so part of its perturbation is the renormalisation; the sigmoid arm does
not renormalise, so its rows simply lose mass.

Two protocols, and which one this file computes:
- ``support_removal_perturbation_B`` perturbs one layer in isolation: the same q, k, v with and
  without removal. Cheap, and a property of that layer's attention alone.
- The paper runs a second forward pass with removal at *every* layer, so a layer's q, k, v in
  that pass already carry the upstream perturbation (this compounds with depth; its p = 0.5
  sigmoid average of 3.666 is far above what one layer can give). For that protocol a model hook
  draws ``sample_removal_mask_BT`` per layer, runs ``masked_attention_BHTD`` with it in the second
  pass, and compares the two passes' outputs with ``relative_perturbation_B``
  (``probes/model_probes.py::support_removal_by_layer``, protocol ``compound``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd
import torch

from stabilitylab.probes.masked_attention import check_kind, check_qkv, masked_attention_BHTD

N_SINKS = 4


def removal_count(n_eligible: int, p: float) -> int:
    """``floor(p * n_eligible + 1/2)``: round half up (Python's ``round`` rounds half to even)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"removal fraction p must be in [0, 1], got {p}")
    if n_eligible < 0:
        raise ValueError(f"n_eligible must be >= 0, got {n_eligible}")
    return min(n_eligible, math.floor(p * n_eligible + 0.5))


def sample_removal_mask_BT(
    lengths_B: torch.Tensor,
    T: int,
    p: float,
    generator: torch.Generator,
    n_sinks: int = N_SINKS,
) -> torch.Tensor:
    """``removed_BT``: True at the positions removed from each sequence (module doc).

    Draws with ``torch.randperm`` from ``generator`` (a CPU generator), one permutation per
    sequence in batch order, so a seed reproduces the masks. The mask lives on
    ``lengths_B``'s device.
    """
    if n_sinks < 0:
        raise ValueError(f"n_sinks must be >= 0, got {n_sinks}")
    lengths = [int(n) for n in lengths_B.tolist()]
    if any(n < 1 or n > T for n in lengths):
        raise ValueError(f"lengths_B must lie in [1, T={T}], got {lengths}")
    removed_BT = torch.zeros(len(lengths), T, dtype=torch.bool)
    for b, n_valid in enumerate(lengths):
        n_eligible = max(0, n_valid - n_sinks)
        m = removal_count(n_eligible, p)
        picked = torch.randperm(n_eligible, generator=generator)[:m] + n_sinks
        removed_BT[b, picked] = True
    return removed_BT.to(lengths_B.device)


def relative_perturbation_B(
    out_BHTD: torch.Tensor, out_tilde_BHTD: torch.Tensor, lengths_B: torch.Tensor
) -> torch.Tensor:
    """``||O~_b - O_b||_F / ||O_b||_F`` over heads, valid tokens and head dim, per sequence.

    Padded rows are left out of both norms. A sequence whose reference output is all zero gives
    NaN (0/0) or inf: there is nothing to be relative to.
    """
    if out_BHTD.shape != out_tilde_BHTD.shape or out_BHTD.dim() != 4:
        raise ValueError(
            f"outputs must share one (B, H, T, D) shape, got {tuple(out_BHTD.shape)} and "
            f"{tuple(out_tilde_BHTD.shape)}"
        )
    B, H, T, D = out_BHTD.shape
    valid_B1T1 = (torch.arange(T, device=lengths_B.device)[None, :] < lengths_B[:, None])[
        :, None, :, None
    ]
    diff = ((out_tilde_BHTD - out_BHTD) * valid_B1T1).flatten(1).norm(dim=1)
    base = (out_BHTD * valid_B1T1).flatten(1).norm(dim=1)
    return diff / base


def support_removal_perturbation_B(
    q_BHTD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    lengths_B: torch.Tensor,
    *,
    kind: str,
    p: float,
    generator: torch.Generator,
    causal: bool = False,
    key_bias_BT: torch.Tensor | None = None,
    sigmoid_bias: float | None = None,
    scale: float | None = None,
    n_sinks: int = N_SINKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer in isolation: ``(delta_B, removed_BT)`` for a fresh random removal mask.

    ``delta_B`` is ``relative_perturbation_B`` of the layer's attention output (before the output
    projection) with and without the removal; ``removed_BT`` is the mask drawn.
    """
    check_kind(kind)
    check_qkv(q_BHTD, k_BHTD, lengths_B, v_BHTD=v_BHTD, key_bias_BT=key_bias_BT)
    removed_BT = sample_removal_mask_BT(lengths_B, q_BHTD.shape[2], p, generator, n_sinks)
    common = dict(
        kind=kind, causal=causal, key_bias_BT=key_bias_BT, sigmoid_bias=sigmoid_bias, scale=scale
    )
    out_BHTD = masked_attention_BHTD(q_BHTD, k_BHTD, v_BHTD, lengths_B, **common)
    out_tilde_BHTD = masked_attention_BHTD(
        q_BHTD, k_BHTD, v_BHTD, lengths_B, removed_BT=removed_BT, **common
    )
    return relative_perturbation_B(out_BHTD, out_tilde_BHTD, lengths_B), removed_BT


def mean_over_sequences(deltas: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Mean of per-sequence perturbations, given one ``delta_B`` or a list of them (batches)."""
    flat = torch.cat([torch.as_tensor(d).flatten() for d in _as_list(deltas)])
    if flat.numel() == 0:
        raise ValueError("no perturbations to average")
    return float(flat.double().mean())


def support_removal_table(
    deltas_by_layer_p: Mapping[tuple[int, float], torch.Tensor | Sequence[torch.Tensor]],
) -> pd.DataFrame:
    """Tidy table, one row per (layer, p): ``layer, p, perturbation, std, n_sequences``.

    ``perturbation`` is the mean over sequences (the paper's per-layer curve); ``std`` is the
    population spread across sequences.
    """
    rows = []
    for (layer, p), deltas in sorted(deltas_by_layer_p.items()):
        flat = torch.cat([torch.as_tensor(d).flatten() for d in _as_list(deltas)]).double()
        if flat.numel() == 0:
            raise ValueError(f"no perturbations for layer {layer}, p {p}")
        rows.append(
            dict(
                layer=int(layer),
                p=float(p),
                perturbation=float(flat.mean()),
                std=float(flat.std(correction=0)),
                n_sequences=int(flat.numel()),
            )
        )
    return pd.DataFrame(rows, columns=["layer", "p", "perturbation", "std", "n_sequences"])


def layer_average_by_p(table: pd.DataFrame) -> pd.DataFrame:
    """The paper's summary: per p, the mean over layers of the sequence-averaged perturbation."""
    out = table.groupby("p", as_index=False).agg(
        perturbation=("perturbation", "mean"), n_layers=("layer", "nunique")
    )
    return out


def _as_list(x: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [x] if isinstance(x, torch.Tensor) else list(x)
