"""Intervals that decide a comparison: paired bootstrap over evaluation windows, t over seeds.

A perplexity is ``PPL = exp(sum_n nll_n / sum_n tokens_n)`` over windows ``n``. Two policies or
models scored on the *same* windows are compared by the paired bootstrap: draw the windows with
replacement (one draw shared by both sides), recompute ``PPL_a - PPL_b`` on the draw, and take
the 2.5% and 97.5% quantiles of ``n_boot`` draws (percentile interval). Pairing removes the
window-to-window spread both sides share (a hard passage is hard for every policy), which is most
of it. A comparison is *decided* when its interval excludes 0.

Over seeds (independent trainings), ``seed_interval`` gives the mean and the Student-t 95%
interval ``mean +- t_{0.975, k-1} s / sqrt(k)`` of ``k`` per-seed values.

NaN is data: a NaN among the inputs gives a NaN estimate and NaN bounds, never a silently
smaller sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

N_BOOT = 2000
LEVEL = 0.95

# Student t quantiles t_{0.975, df} for df = 1 .. 30 (two-sided 95%); beyond, the normal 1.96
# is within 2%. Tabulated so that the lab needs no scipy.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


@dataclass(frozen=True)
class Interval:
    estimate: float
    lo: float
    hi: float

    @property
    def verdict(self) -> str:
        """``a < b`` / ``a > b`` when the interval of ``a - b`` excludes 0, else undecided."""
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            return "undecided"
        if self.hi < 0:
            return "a < b"
        if self.lo > 0:
            return "a > b"
        return "undecided"


NAN_INTERVAL = Interval(math.nan, math.nan, math.nan)


def ppl(nll_N: np.ndarray, tokens_N: np.ndarray) -> float:
    return float(np.exp(np.sum(nll_N) / np.sum(tokens_N)))


def _draws(n: int, n_boot: int, seed: int) -> np.ndarray:
    """``(n_boot, n)`` window counts of the bootstrap draws (multinomial: the same draws as
    resampling indices, as weights)."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def _check(*arrays: np.ndarray) -> int:
    n = len(arrays[0])
    for a in arrays:
        if a.ndim != 1 or len(a) != n:
            raise ValueError(
                f"per-window arrays must be 1-D of one length, got {[x.shape for x in arrays]}"
            )
    if n == 0:
        raise ValueError("no window to bootstrap")
    return n


def _quantiles(stat_K: np.ndarray, estimate: float, level: float) -> Interval:
    if not math.isfinite(estimate) or not np.isfinite(stat_K).all():
        return Interval(estimate, math.nan, math.nan)
    lo, hi = np.quantile(stat_K, [(1 - level) / 2, (1 + level) / 2])
    return Interval(estimate, float(lo), float(hi))


def ppl_interval(
    nll_N: np.ndarray, tokens_N: np.ndarray, *, n_boot: int = N_BOOT, seed: int = 0,
    level: float = LEVEL,
) -> Interval:  # fmt: skip
    """PPL over the windows and its bootstrap interval."""
    nll_N, tokens_N = np.asarray(nll_N, np.float64), np.asarray(tokens_N, np.float64)
    n = _check(nll_N, tokens_N)
    w_KN = _draws(n, n_boot, seed)
    stat_K = np.exp((w_KN @ nll_N) / (w_KN @ tokens_N))
    return _quantiles(stat_K, ppl(nll_N, tokens_N), level)


def paired_ppl_difference(
    nll_a_N: np.ndarray, nll_b_N: np.ndarray, tokens_N: np.ndarray, *, n_boot: int = N_BOOT,
    seed: int = 0, level: float = LEVEL,
) -> Interval:  # fmt: skip
    """``PPL_a - PPL_b`` on the same windows and its paired bootstrap interval."""
    a, b = np.asarray(nll_a_N, np.float64), np.asarray(nll_b_N, np.float64)
    tokens_N = np.asarray(tokens_N, np.float64)
    n = _check(a, b, tokens_N)
    w_KN = _draws(n, n_boot, seed)
    t_K = w_KN @ tokens_N
    stat_K = np.exp((w_KN @ a) / t_K) - np.exp((w_KN @ b) / t_K)
    return _quantiles(stat_K, ppl(a, tokens_N) - ppl(b, tokens_N), level)


def t_quantile(df: int) -> float:
    """``t_{0.975, df}`` (two-sided 95%)."""
    if df < 1:
        return math.nan
    return _T975[df - 1] if df <= len(_T975) else 1.96


def seed_interval(values) -> Interval:
    """Mean over seeds and its Student-t 95% interval (NaN bounds with one seed or any NaN)."""
    v = np.asarray(list(values), np.float64)
    if v.size == 0:
        return NAN_INTERVAL
    mean = float(v.mean())
    if v.size < 2 or not np.isfinite(v).all():
        return Interval(mean, math.nan, math.nan)
    half = t_quantile(v.size - 1) * float(v.std(ddof=1)) / math.sqrt(v.size)
    return Interval(mean, mean - half, mean + half)
