"""Cache policies: which live entries of one layer's cache to drop after a step.

The decode loop (``decode.py``) calls ``policy.drop_BHN(cache, keep_B)`` on every layer's cache
right after that layer attended, in the prefill and in every decode step. So a step's query always
sees its own new entry (it was just computed), and an entry dropped then is gone for every later
step: the paper's "removed after prefill ... the same rule for each newly written entry".

- ``NoEviction``: the dense reference.
- ``GateThreshold(tau)``: drop entry ``j`` of layer ``l + 1`` when the gate ``g_j^(l) < tau``;
  layer 0 has no gate before it and is never evicted. Drops a token from every head at once.
  Applying the rule to every live entry is the same as applying it to the new ones: a kept
  entry's gate does not change.
- ``H2O(heavy_fraction)`` (Zhang et al. 2023, FMInference/H2O ``utils_real_drop``): per head,
  score = attention received, summed over all queries so far (softmax probabilities, or sigmoid
  weights on a sigmoid backbone); with a budget of ``n`` entries per head keep the ``recent =
  n - heavy`` newest and the ``heavy = floor(heavy_fraction * n)`` best-scoring older ones
  (default an equal split, the reference's 0.1 n + 0.1 n). Budget-driven: once a row holds more
  than ``n`` live entries, the excess lowest-scoring non-recent ones go.
- ``KeyDiff()`` (2025, NVIDIA/kvpress ``keydiff_press.py``): per head, anchor = mean of the
  L2-normalised live keys; score = -cos(key, anchor); keep the ``n`` highest. Never reads
  attention. The keys are the cached ones: after QK-norm and RoPE. Applied as a streaming
  budget (drop the excess after every step), as H2O.

The budget ``keep_B`` (live entries per head, per sequence, for this layer) comes from the caller;
``protocol.matched_budget`` sets it equal to a gated model's final live count. Budgets are whole
entries (``check_counts``: no NaN, fraction, negative count or bool); tau and ``heavy_fraction``
are real numbers (``as_real``: Python's or numpy's, never a bool or NaN).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from stabilitylab.eviction.cache import LayerCache


class CachePolicy(Protocol):
    needs_scores: bool
    """The cache must accumulate attention received (H2O)."""
    needs_budget: bool
    """The policy keeps a given number of entries per head; the caller passes ``keep_B``."""

    @property
    def name(self) -> str: ...

    def drop_BHN(self, cache: LayerCache, keep_B: torch.Tensor | None) -> torch.Tensor | None:
        """Entries to remove now (a subset of ``cache.live_BHN``), or None for none."""
        ...


# ---- pure maths -------------------------------------------------------------------------------


def lowest_k_BHN(score_BHN: torch.Tensor, candidate_BHN: torch.Tensor, k_BH: torch.Tensor):
    """Mask of the ``k_BH`` lowest-scoring candidates of each row (ties: the earlier slot).
    Never marks a non-candidate; marks every candidate when ``k`` exceeds their number."""
    s_BHN = score_BHN.masked_fill(~candidate_BHN, math.inf)
    order_BHN = torch.argsort(s_BHN, dim=-1, stable=True)
    rank_BHN = torch.empty_like(order_BHN)
    rank_BHN.scatter_(
        -1, order_BHN, torch.arange(s_BHN.shape[-1], device=s_BHN.device).expand_as(order_BHN)
    )
    return candidate_BHN & (rank_BHN < k_BH[..., None])


def newest_k_BHN(pos_BHN: torch.Tensor, live_BHN: torch.Tensor, k_BH: torch.Tensor):
    """Mask of the ``k_BH`` live entries with the highest positions in each row."""
    return lowest_k_BHN(-pos_BHN.to(torch.float64), live_BHN, k_BH)


def keydiff_score_BHN(k_BHND: torch.Tensor, live_BHN: torch.Tensor) -> torch.Tensor:
    """``-cos(k_j, anchor)`` with ``anchor = mean_j over live of k_j / |k_j|`` per (b, h). A slot
    that is not live never reaches the anchor, whatever it holds (the engine's pool is
    uninitialised memory there: NaN * 0 would make every score NaN and evict nothing)."""
    unit_BHND = F.normalize(k_BHND.to(torch.promote_types(k_BHND.dtype, torch.float32)), dim=-1)
    unit_BHND = torch.where(live_BHN[..., None], unit_BHND, 0.0)
    n_BH11 = live_BHN.sum(2, keepdim=True)[..., None].clamp(min=1).to(unit_BHND.dtype)
    anchor_BH1D = unit_BHND.sum(2, keepdim=True) / n_BH11
    return -F.cosine_similarity(unit_BHND, anchor_BH1D, dim=-1)


def excess_BH(cache: LayerCache, keep_B: torch.Tensor) -> torch.Tensor:
    """Live entries above the budget in each row (0 where within it)."""
    return (cache.live_count_BH() - keep_B[:, None]).clamp(min=0)


def check_budget_B(keep_B: torch.Tensor | None, B: int) -> torch.Tensor:
    if keep_B is None or tuple(keep_B.shape) != (B,):
        got = None if keep_B is None else tuple(keep_B.shape)
        raise ValueError(f"a budgeted policy needs keep_B of shape ({B},), got {got}")
    check_counts(keep_B, "keep_B")
    return keep_B


def check_counts(counts, what: str) -> None:
    """Refuse a budget that is not whole entries: a bool dtype, NaN or inf, a fraction, a
    negative count (a NaN budget compares false with every rank and would evict nothing; a
    fraction would be cut to an int without a word). ``counts``: a tensor or an array."""
    t = torch.as_tensor(counts)
    if t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{what} must hold entry counts (integers), got dtype {t.dtype}")
    if t.is_floating_point():
        bad = ~torch.isfinite(t) | (t != torch.round(t))
        if bool(bad.any()):
            raise ValueError(
                f"{what} must hold whole entry counts, got {t[bad].flatten()[0].item()!r} at "
                f"index {tuple(int(i) for i in bad.nonzero()[0])}"
            )
    if bool((t < 0).any()):
        raise ValueError(f"{what} must hold counts >= 0, got {t[t < 0].flatten()[0].item()!r}")


def as_real(x) -> float | None:
    """``x`` as a float when it is a real number, Python's or numpy's (``np.float32(0.5)``);
    None for a bool (``True`` is not tau = 1), NaN, a string, a tensor."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real) or math.isnan(x):
        return None
    return float(x)


# ---- policies ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NoEviction:
    needs_scores = False
    needs_budget = False

    @property
    def name(self) -> str:
        return "dense"

    def drop_BHN(self, cache, keep_B=None):
        return None


@dataclass(frozen=True)
class GateThreshold:
    tau: float
    needs_scores = False
    needs_budget = False

    def __post_init__(self):
        tau = as_real(self.tau)
        if tau is None or not 0.0 <= tau <= 1.0:
            raise ValueError(f"gate threshold tau must be a number in [0, 1], got {self.tau!r}")
        object.__setattr__(self, "tau", tau)  # a plain float: names and tables print it alike

    @property
    def name(self) -> str:
        return f"gate(tau={self.tau:g})"

    def drop_BHN(self, cache, keep_B=None):
        if cache.g_BHN is None:  # layer 0, or a dense model: nothing gates these entries
            return None
        return cache.live_BHN & (cache.g_BHN < self.tau)


@dataclass(frozen=True)
class H2O:
    heavy_fraction: float = 0.5
    needs_scores = True
    needs_budget = True

    def __post_init__(self):
        heavy = as_real(self.heavy_fraction)
        if heavy is None or not 0.0 <= heavy <= 1.0:
            raise ValueError(f"H2O heavy_fraction must be in [0, 1], got {self.heavy_fraction!r}")
        object.__setattr__(self, "heavy_fraction", heavy)

    @property
    def name(self) -> str:
        return f"h2o(heavy={self.heavy_fraction:g})"

    def drop_BHN(self, cache, keep_B=None):
        keep_B = check_budget_B(keep_B, cache.k_BHND.shape[0])
        heavy_B = torch.floor(keep_B.to(torch.float64) * self.heavy_fraction).long()
        recent_BH = (keep_B - heavy_B)[:, None].expand_as(cache.live_BHN[..., 0])
        recent_BHN = newest_k_BHN(cache.pos_BHN, cache.live_BHN, recent_BH)
        return lowest_k_BHN(cache.score_BHN, cache.live_BHN & ~recent_BHN, excess_BH(cache, keep_B))


@dataclass(frozen=True)
class KeyDiff:
    needs_scores = False
    needs_budget = True

    @property
    def name(self) -> str:
        return "keydiff"

    def drop_BHN(self, cache, keep_B=None):
        keep_B = check_budget_B(keep_B, cache.k_BHND.shape[0])
        score_BHN = keydiff_score_BHN(cache.k_BHND, cache.live_BHN)
        return lowest_k_BHN(score_BHN, cache.live_BHN, excess_BH(cache, keep_B))
