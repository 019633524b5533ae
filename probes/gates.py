"""Gate statistics per layer: mean gate and binarization, for the trainer's log and the study.

Gates ``g`` are the per-token outputs of each gated layer's sigmoid (one per token, shared by
every head), stacked as ``gates_LBT``; ``lengths_B`` marks the valid positions. Per layer::

    mean       = mean_{valid (b, t)} g
    frac_low   = fraction of valid g <  low    (low  = 0.05)
    frac_high  = fraction of valid g >  high   (high = 0.95)
    frac_binary = frac_low + frac_high         the paper's "binarization"

Confirmed by the paper: the thresholds 0.05 / 0.95 with strict inequalities, and an aggregate
"averaged across gate layers and test token positions". Inferred: that aggregate pools every
(layer, position) pair, which equals the mean of the per-layer fractions when each layer sees
the same positions (it does here).

The sums are kept apart from the ratios so that batches can be accumulated exactly
(``GateSums`` adds) and so that the trainer reduces on the device and synchronises once: every
function here returns tensors and never calls ``.item()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch

LOW, HIGH = 0.05, 0.95


@dataclass(frozen=True)
class GateSums:
    """Per-layer sums over valid positions: ``total_L`` (sum of g), ``low_L``, ``high_L``
    (counts below ``low`` / above ``high``) and ``count_L`` (number of valid positions)."""

    total_L: torch.Tensor
    low_L: torch.Tensor
    high_L: torch.Tensor
    count_L: torch.Tensor

    def __add__(self, other: GateSums) -> GateSums:
        if self.count_L.shape != other.count_L.shape:
            raise ValueError(
                f"cannot add gate sums of {self.count_L.numel()} and {other.count_L.numel()} layers"
            )
        return GateSums(
            self.total_L + other.total_L,
            self.low_L + other.low_L,
            self.high_L + other.high_L,
            self.count_L + other.count_L,
        )


def _stack_gates(gates_LBT: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if not isinstance(gates_LBT, torch.Tensor):
        gates_LBT = torch.stack(list(gates_LBT))
    if gates_LBT.dim() != 3:
        raise ValueError(f"gates_LBT must have shape (layers, B, T), got {tuple(gates_LBT.shape)}")
    return gates_LBT


def gate_sums(
    gates_LBT: torch.Tensor | Sequence[torch.Tensor],
    lengths_B: torch.Tensor,
    low: float = LOW,
    high: float = HIGH,
) -> GateSums:
    """``GateSums`` of one batch; ``gates_LBT`` may be a list of per-layer ``gates_BT``.

    Sums in float64 (exact counts, no drift when accumulated over a test split).
    """
    gates_LBT = _stack_gates(gates_LBT)
    L, B, T = gates_LBT.shape
    if lengths_B.shape != (B,):
        raise ValueError(f"lengths_B shape {tuple(lengths_B.shape)} != ({B},)")
    if not low < high:
        raise ValueError(f"gate thresholds need low < high, got low={low}, high={high}")
    valid_1BT = (torch.arange(T, device=gates_LBT.device)[None, :] < lengths_B[:, None])[None]
    g_LBT = gates_LBT.detach().double()
    count = valid_1BT.sum(dtype=torch.float64).expand(L)
    return GateSums(
        total_L=(g_LBT * valid_1BT).sum(dim=(1, 2)),
        low_L=((g_LBT < low) & valid_1BT).sum(dim=(1, 2), dtype=torch.float64),
        high_L=((g_LBT > high) & valid_1BT).sum(dim=(1, 2), dtype=torch.float64),
        count_L=count.clone(),
    )


def gate_stats(sums: GateSums) -> dict[str, torch.Tensor]:
    """Per-layer ratios: ``mean_L, frac_low_L, frac_high_L, frac_binary_L`` (tensors)."""
    n_L = sums.count_L
    frac_low_L, frac_high_L = sums.low_L / n_L, sums.high_L / n_L
    return dict(
        mean_L=sums.total_L / n_L,
        frac_low_L=frac_low_L,
        frac_high_L=frac_high_L,
        frac_binary_L=frac_low_L + frac_high_L,
    )


def gate_stats_LBT(
    gates_LBT: torch.Tensor | Sequence[torch.Tensor],
    lengths_B: torch.Tensor,
    low: float = LOW,
    high: float = HIGH,
) -> dict[str, torch.Tensor]:
    """The trainer's one call: ``gate_stats(gate_sums(gates_LBT, lengths_B))``."""
    return gate_stats(gate_sums(gates_LBT, lengths_B, low, high))


def pooled_gate_stats(sums: GateSums) -> dict[str, float]:
    """Over all layers and positions together (the paper's aggregate binarization)."""
    n = float(sums.count_L.sum())
    if n == 0:
        raise ValueError("no valid gate positions to pool")
    low, high = float(sums.low_L.sum()) / n, float(sums.high_L.sum()) / n
    return dict(
        mean=float(sums.total_L.sum()) / n, frac_low=low, frac_high=high, frac_binary=low + high
    )


def gate_stats_table(sums: GateSums, first_layer: int = 0) -> pd.DataFrame:
    """Tidy table, one row per gate layer: ``layer, mean, frac_low, frac_high, frac_binary, count``.

    ``first_layer`` numbers the rows (the layer that emits the first gate; the last layer emits
    none).
    """
    stats = {k: v.detach().cpu().double().tolist() for k, v in gate_stats(sums).items()}
    counts = sums.count_L.detach().cpu().tolist()
    return pd.DataFrame(
        dict(
            layer=[first_layer + i for i in range(len(counts))],
            mean=stats["mean_L"],
            frac_low=stats["frac_low_L"],
            frac_high=stats["frac_high_L"],
            frac_binary=stats["frac_binary_L"],
            count=[int(c) for c in counts],
        )
    )
