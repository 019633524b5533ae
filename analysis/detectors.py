"""Divergence detectors: pure, vectorised functions over one logged series.

Every detector has the form ``fn(steps, values, **params) -> Detection | None`` and returns the
*first* logged point at which it fires, judged only from that point and the points before it.
So the same call answers the trainer online (on the history so far, every few steps) and the
report offline (on the whole run), and an online alarm at step s is also the offline one.

Layout: ``steps`` and ``values`` are 1-D and of equal length, ``steps`` non-decreasing (one
point per logged step, as ``stabilitylab.analysis.events`` returns them). Non-finite values are
reported by ``nonfinite`` only; the other detectors skip them, so a NaN never hides or fakes a
statistic. Cost is O(n) numpy/pandas work except where a docstring says otherwise: each took
2-22 ms on 1e5 points on 2 shared CPU cores (measured by hand, 2026-12-07; no test times them).

False-alarm floors: ``grad_explosion_zscore``'s ``min_std``, ``rolling_sigma``'s
``min_rel_std`` and ``logit_runaway``'s ``min_value`` keep a flat series or small early logits
from firing (tests/test_analysis.py pins each on curves that fire without it).

``diverged`` is the run-level rule: the trainer's stop policy and the report's status.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd


@dataclass(frozen=True)
class Detection:
    detector: str
    step: int
    value: float
    detail: str


def _as_series(steps, values) -> tuple[np.ndarray, np.ndarray]:
    steps_N = np.asarray(steps)
    values_N = np.asarray(values, dtype=np.float64)
    if steps_N.ndim != 1 or values_N.ndim != 1:
        raise ValueError(
            f"steps and values must be 1-D, got shapes {steps_N.shape} and {values_N.shape}"
        )
    if steps_N.shape != values_N.shape:
        raise ValueError(
            f"steps and values differ in length: {steps_N.shape[0]} vs {values_N.shape[0]}"
        )
    steps_N = steps_N.astype(np.int64)
    if steps_N.size > 1 and np.any(np.diff(steps_N) < 0):
        raise ValueError("steps must be non-decreasing (sort the series by step first)")
    return steps_N, values_N


def _check_positive(**params: float) -> None:
    for name, v in params.items():
        if not v > 0:
            raise ValueError(f"detector parameter {name} must be positive, got {v}")


def _first(mask_N: np.ndarray) -> int | None:
    idx = np.flatnonzero(mask_N)
    return int(idx[0]) if idx.size else None


def _finite(steps_N: np.ndarray, values_N: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    keep_N = np.isfinite(values_N)
    return steps_N[keep_N], values_N[keep_N]


def _prev_rolling(values_N: np.ndarray, window: int, min_history: int):
    """Rolling statistics of the ``window`` points strictly before each point (pandas, O(n))."""
    return pd.Series(values_N).shift(1).rolling(window, min_periods=min(min_history, window))


def nonfinite(steps, values) -> Detection | None:
    """First logged value that is NaN or +-inf."""
    steps_N, values_N = _as_series(steps, values)
    i = _first(~np.isfinite(values_N))
    if i is None:
        return None
    return Detection("nonfinite", int(steps_N[i]), float(values_N[i]), f"value is {values_N[i]}")


def loss_divergence(
    steps,
    values,
    *,
    n_initial: int = 5,
    smooth: int = 5,
    level: float = 1.0,
    min_progress: float = 0.05,
    jump: float = 0.5,
    window: int = 50,
) -> Detection | None:
    """Loss back above its initial level, or a jump that gives back much of what it learned.

    ``L0`` = mean of the first ``n_initial`` finite points; ``s_t`` = mean of the last ``smooth``
    points up to t (a one-batch spike is not a divergence). Progress counts only once it reaches
    ``min_progress * |L0|`` (the run learned something, so noise at the start cannot fire):

        back above:  min(s before t) <= L0 - min_progress * |L0|   and   s_t >= level * L0
        jump:        p_t = L0 - m_t >= min_progress * |L0|   and   s_t - m_t >= jump * p_t

    with ``m_t`` = min of ``s`` over the ``window`` points before t (the jump gave back
    ``jump`` of the recent progress). The all-time min in the first rule lets a slow climb back,
    longer than ``window``, still fire.
    """
    _check_positive(n_initial=n_initial, smooth=smooth, level=level)
    _check_positive(min_progress=min_progress, jump=jump, window=window)
    steps_N, values_N = _finite(*_as_series(steps, values))
    warmup = max(n_initial, smooth)
    if values_N.size <= warmup:
        return None
    loss0 = float(values_N[:n_initial].mean())
    margin = min_progress * abs(loss0)
    smooth_N = pd.Series(values_N).rolling(smooth, min_periods=1).mean().to_numpy()
    best_N = np.minimum.accumulate(np.concatenate([[np.inf], smooth_N[:-1]]))
    min_N = _prev_rolling(smooth_N, window, 1).min().to_numpy()
    progress_N = loss0 - min_N
    with np.errstate(invalid="ignore"):
        above_N = (loss0 - best_N >= margin) & (smooth_N >= level * loss0)
        jumped_N = (progress_N >= margin) & (smooth_N - min_N >= jump * progress_N)
    fired_N = above_N | jumped_N
    fired_N[:warmup] = False
    i = _first(fired_N)
    if i is None:
        return None
    how = "above initial" if above_N[i] else "jump over rolling min"
    return Detection(
        "loss_divergence",
        int(steps_N[i]),
        float(values_N[i]),
        f"{how}: smoothed loss {smooth_N[i]:.4g}, initial {loss0:.4g}, rolling min {min_N[i]:.4g}",
    )


def grad_explosion_ratio(
    steps, values, *, ratio: float = 10.0, window: int = 50
) -> Detection | None:
    """Grad norm at least ``ratio`` x the median of the previous block of ``window`` points.

    Points are cut into consecutive blocks of ``window``; point t in block b compares against
    the median of block b-1 (so its reference holds between ``window`` and ``2*window - 1``
    points before it). An exact per-point rolling median costs ~0.1 s on 1e5 points with pandas;
    the block median is O(n), and a spike inside the current block cannot raise its own bar.
    No alarm in the first block.
    """
    _check_positive(ratio=ratio, window=window)
    steps_N, values_N = _finite(*_as_series(steps, values))
    n_blocks = values_N.size // window
    if n_blocks == 0:
        return None
    median_K = np.median(values_N[: n_blocks * window].reshape(n_blocks, window), axis=1)
    block_N = np.arange(values_N.size) // window
    ref_N = np.full(values_N.size, np.nan)
    has_ref_N = block_N >= 1
    ref_N[has_ref_N] = median_K[block_N[has_ref_N] - 1]
    with np.errstate(invalid="ignore"):
        i = _first(has_ref_N & (values_N >= ratio * ref_N))
    if i is None:
        return None
    return Detection(
        "grad_explosion_ratio",
        int(steps_N[i]),
        float(values_N[i]),
        f"{values_N[i] / ref_N[i]:.3g}x the previous block median {ref_N[i]:.4g}",
    )


def grad_explosion_zscore(
    steps,
    values,
    *,
    z: float = 6.0,
    window: int = 100,
    min_history: int = 20,
    min_std: float = 0.05,
) -> Detection | None:
    """Rolling z-score of ``log(grad norm)`` against the ``window`` points before it.

        z_t = (log g_t - mean(log g_prev)) / max(std(log g_prev), min_std) >= ``z``

    ``min_std`` (in log units: 0.05 ~ 5 %) keeps a nearly constant series from firing on a
    tiny step. Non-positive values are skipped (no log).
    """
    _check_positive(z=z, window=window, min_history=min_history, min_std=min_std)
    steps_N, values_N = _finite(*_as_series(steps, values))
    keep_N = values_N > 0
    steps_N, values_N = steps_N[keep_N], values_N[keep_N]
    log_N = np.log(values_N)
    prev = _prev_rolling(log_N, window, min_history)
    mean_N = prev.mean().to_numpy()
    std_N = np.maximum(prev.std().to_numpy(), min_std)
    with np.errstate(invalid="ignore"):
        z_N = (log_N - mean_N) / std_N
        i = _first(z_N >= z)
    if i is None:
        return None
    return Detection(
        "grad_explosion_zscore",
        int(steps_N[i]),
        float(values_N[i]),
        f"z = {z_N[i]:.3g} on log grad norm (rolling mean {np.exp(mean_N[i]):.4g})",
    )


def _log_growth(
    name: str, steps, values, *, factor: float, window: int, min_value: float
) -> Detection | None:
    """First t with ``v_t / v_{t-window} >= factor`` and ``v_t >= min_value`` (positive values)."""
    _check_positive(factor=factor, window=window)
    steps_N, values_N = _finite(*_as_series(steps, values))
    keep_N = values_N > 0
    steps_N, values_N = steps_N[keep_N], values_N[keep_N]
    if values_N.size <= window:
        return None
    growth_N = np.full(values_N.size, np.nan)
    growth_N[window:] = values_N[window:] / values_N[:-window]
    with np.errstate(invalid="ignore"):
        i = _first((growth_N >= factor) & (values_N >= min_value))
    if i is None:
        return None
    span = int(steps_N[i] - steps_N[i - window])
    rate = np.log(growth_N[i]) / span if span > 0 else float("inf")
    return Detection(
        name,
        int(steps_N[i]),
        float(values_N[i]),
        f"x{growth_N[i]:.3g} over {span} steps ({rate:.3g} e-folds/step)",
    )


def logit_runaway(
    steps, values, *, factor: float = 4.0, window: int = 4, min_value: float = 30.0
) -> Detection | None:
    """Growth rate of a max attention logit: ``x factor`` within ``window`` logged points.

    Fires at the first t with ``v_t / v_{t-window} >= factor`` and ``v_t >= min_value``. The
    floor ignores the fast relative growth of small logits early in training; 30 saturates
    softmax (e^30) and sigmoid alike. With logits logged every 50 steps the defaults mean
    "x4 within 200 steps"; the detail gives the rate in e-folds per step.
    """
    return _log_growth(
        "logit_runaway", steps, values, factor=factor, window=window, min_value=min_value
    )


def jacobian_growth(
    steps, values, *, factor: float = 4.0, window: int = 4, min_value: float = 0.0
) -> Detection | None:
    """Growth of the probed attention-Jacobian spectral norm: ``x factor`` in ``window`` points."""
    return _log_growth(
        "jacobian_growth", steps, values, factor=factor, window=window, min_value=min_value
    )


def loss_blowup(
    steps,
    values,
    *,
    factor: float = 2.0,
    sustain: int = 5,
    sustain_cold: int = 50,
    min_progress: float = 0.02,
) -> Detection | None:
    """A sustained loss blow-up: a failure that ``diverged``'s grad-norm rule can miss (a
    100-300x grad-norm rise with the loss at 10-40x its start, docs/RESULTS.md).

    ``L0`` = the first finite point (the loss before training moved it). With ``high`` = points
    ``>= factor * L0``, fires at the first point t that ends

        after learning:  ``sustain`` high points in a row, starting after a point (other than
                         the first) at or below ``L0 - min_progress * |L0|``
        cold:            ``sustain_cold`` high points in a row, learning or not

    An early transient (large init, no warmup) that settles is shorter than ``sustain_cold``;
    a run that never comes down is caught by the cold clause. Reported beside ``diverged``;
    not part of it.
    """
    _check_positive(factor=factor, sustain=sustain, sustain_cold=sustain_cold)
    _check_positive(min_progress=min_progress)
    steps_N, values_N = _finite(*_as_series(steps, values))
    if values_N.size < 2:
        return None
    loss0 = float(values_N[0])
    high = pd.Series(values_N >= factor * loss0)
    ends_run_N = high.rolling(sustain, min_periods=sustain).sum().to_numpy() == sustain
    ends_cold_N = (
        high.rolling(sustain_cold, min_periods=sustain_cold).sum().to_numpy() == sustain_cold
    )
    down_N = values_N <= loss0 - min_progress * abs(loss0)
    down_N[0] = False  # the first point is L0 itself
    came_down_N = np.maximum.accumulate(down_N)
    # A run of high points ending at t starts at t - sustain + 1: it must follow the coming down.
    start = np.arange(values_N.size) - (sustain - 1)
    after_learning_N = ends_run_N & (start >= 1) & came_down_N[np.maximum(start - 1, 0)]
    i = _first(after_learning_N | ends_cold_N)
    if i is None:
        return None
    how = "after learning" if after_learning_N[i] else "from the start"
    n = sustain if after_learning_N[i] else sustain_cold
    return Detection(
        "loss_blowup",
        int(steps_N[i]),
        float(values_N[i]),
        f"loss >= {factor:g}x initial {loss0:.4g} for {n} logged points {how}",
    )


def rolling_sigma(
    steps,
    values,
    *,
    k: float = 6.0,
    window: int = 100,
    min_history: int = 20,
    min_rel_std: float = 0.01,
) -> Detection | None:
    """Spike rule common in large-scale training: ``v_t > mean + k * std`` of the previous window.

    Linear scale (used on loss and on grad norm). The std is floored at ``min_rel_std * |mean|``
    so a flat series does not fire on rounding noise.
    """
    _check_positive(k=k, window=window, min_history=min_history, min_rel_std=min_rel_std)
    steps_N, values_N = _finite(*_as_series(steps, values))
    prev = _prev_rolling(values_N, window, min_history)
    mean_N = prev.mean().to_numpy()
    std_N = np.maximum(prev.std().to_numpy(), min_rel_std * np.abs(mean_N))
    with np.errstate(invalid="ignore"):
        i = _first(values_N > mean_N + k * std_N)
    if i is None:
        return None
    return Detection(
        "rolling_sigma",
        int(steps_N[i]),
        float(values_N[i]),
        f"{(values_N[i] - mean_N[i]) / std_N[i]:.3g} sigma above rolling mean {mean_N[i]:.4g}",
    )


def diverged(
    loss_steps,
    loss,
    gn_steps,
    gn,
    *,
    grad_ratio: float = 1e3,
    n_initial: int = 5,
    min_history: int = 3,
) -> Detection | None:
    """The run-level divergence rule (trainer stop policy and report status).

    Fires at the earliest of
      * the first non-finite loss or grad norm;
      * the first grad-norm point t with ``g_t >= grad_ratio * median(g_s, s < t)`` (all earlier
        finite points, at least ``min_history`` of them) and ``L_t >= L0``, where ``L_t`` is the
        last loss logged at or before t and ``L0`` the mean of the first ``n_initial`` finite
        losses. The loss half only counts once those ``n_initial`` points exist, so the rule
        gives the same answer online (partial history) as offline.

    Both conditions: a grad spike that training absorbs is not a divergence, and neither is a
    loss that never went down. The earlier median is exact; it is computed only at points that
    pass cheap bounds (``g_t >= grad_ratio * running min`` and the loss condition), so a stable
    run costs O(n); a run whose grad norm already spans ``grad_ratio`` with the loss above its
    start costs one O(n) median per such point until the rule fires.
    """
    _check_positive(grad_ratio=grad_ratio, n_initial=n_initial, min_history=min_history)
    loss_steps_N, loss_N = _as_series(loss_steps, loss)
    gn_steps_N, gn_N = _as_series(gn_steps, gn)
    bad_loss = nonfinite(loss_steps_N, loss_N)
    bad_gn = nonfinite(gn_steps_N, gn_N)
    bad = [(d, name) for d, name in ((bad_loss, "loss"), (bad_gn, "grad norm")) if d is not None]
    first_bad = min(bad, key=lambda pair: pair[0].step) if bad else None
    limit = first_bad[0].step if first_bad is not None else None

    explosion = _grad_and_loss(
        loss_steps_N, loss_N, gn_steps_N, gn_N, grad_ratio, n_initial, min_history, limit
    )
    if explosion is not None:
        return explosion
    if first_bad is None:
        return None
    d, name = first_bad
    return Detection("nonfinite", d.step, d.value, f"non-finite {name} ({d.value})")


def _grad_and_loss(
    loss_steps_N, loss_N, gn_steps_N, gn_N, grad_ratio, n_initial, min_history, limit
):
    """First grad-norm explosion with the loss above its start (see ``diverged``)."""
    finite_loss = np.isfinite(loss_N)
    if finite_loss.sum() < n_initial:
        return None
    loss_f_steps, loss_f = loss_steps_N[finite_loss], loss_N[finite_loss]
    loss0 = float(loss_f[:n_initial].mean())
    ready_step = loss_f_steps[n_initial - 1]

    gn_steps_f, gn_f = _finite(gn_steps_N, gn_N)
    if limit is not None:
        keep = gn_steps_f < limit
        gn_steps_f, gn_f = gn_steps_f[keep], gn_f[keep]
    if gn_f.size <= min_history:
        return None
    at_N = np.searchsorted(loss_f_steps, gn_steps_f, side="right") - 1
    loss_at_N = np.where(at_N >= 0, loss_f[np.maximum(at_N, 0)], -np.inf)

    prev_min_N = np.minimum.accumulate(np.concatenate([[np.inf], gn_f[:-1]]))
    idx_N = np.arange(gn_f.size)
    candidate_N = (
        (idx_N >= min_history)
        & (gn_steps_f >= ready_step)
        & (loss_at_N >= loss0)
        & (gn_f >= grad_ratio * prev_min_N)
    )
    i = _first_above_prefix_median(gn_f, np.flatnonzero(candidate_N), grad_ratio)
    if i is None:
        return None
    med = float(np.median(gn_f[:i]))
    return Detection(
        "grad_explosion+loss",
        int(gn_steps_f[i]),
        float(gn_f[i]),
        f"grad norm {gn_f[i]:.4g} = {gn_f[i] / med:.3g}x earlier median {med:.4g}; "
        f"loss {loss_at_N[i]:.4g} >= initial {loss0:.4g}",
    )


def _first_above_prefix_median(g_N: np.ndarray, cand_C: np.ndarray, ratio: float) -> int | None:
    """First candidate i (ascending) with ``g_i >= ratio * median(g[:i])``, exactly.

    For a block of candidates at most ``q <= p/8`` points past a sorted prefix ``S`` of size p,
    the median of ``g[:p+q]`` lies in ``[S[(p+q-1)//2 - q], S[(p+q)//2]]`` (q new points shift a
    rank by at most q). Candidates above the upper bound fire, those below the lower bound do
    not, and only the few in between pay for an O(n) ``np.median``. The prefix is re-sorted when
    the candidates move past ``p/8``, so there are O(log n) sorts.
    """
    pos = 0
    while pos < cand_C.size:
        i0 = int(cand_C[pos])
        sorted_S = np.sort(g_N[:i0])
        p = i0
        end = int(np.searchsorted(cand_C, i0 + max(p // 8, 1), side="right"))
        block = cand_C[pos:end]
        q = block - i0
        t = g_N[block] / ratio
        upper = sorted_S[(p + q) // 2]
        lower = sorted_S[(p + q - 1) // 2 - q]
        sure = t >= upper
        maybe = ~sure & (t >= lower)
        for k in np.flatnonzero(sure | maybe):
            i = int(block[k])
            if sure[k] or g_N[i] >= ratio * np.median(g_N[:i]):
                return i
        pos = end
    return None


DETECTORS: dict[str, Callable[..., Detection | None]] = {
    "nonfinite": nonfinite,
    "loss_divergence": loss_divergence,
    "grad_explosion_ratio": grad_explosion_ratio,
    "grad_explosion_zscore": grad_explosion_zscore,
    "logit_runaway": logit_runaway,
    "jacobian_growth": jacobian_growth,
    "rolling_sigma": rolling_sigma,
}
"""Per-series detectors by name (``diverged`` takes two series and is not listed)."""
