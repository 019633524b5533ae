"""Early warning: when each precursor detector first fired, against the divergence step.

    lead = divergence_step - precursor_step     (> 0: warned ahead; < 0: late; None: never / no
                                                  divergence)

Pure function over the tidy scalars of one run arm (``stabilitylab.analysis.events`` layout).
On a stable arm the table still lists where precursors fired: those are its false alarms.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal

import numpy as np
import pandas as pd

from stabilitylab import tags
from stabilitylab.analysis import detectors as det
from stabilitylab.analysis.events import layer_tags, series

COLUMNS = [
    "precursor",
    "tag",
    "detector",
    "step",
    "value",
    "divergence_step",
    "lead_steps",
    "detail",
]
MAX_OVER_LAYERS = "max over layers"


def divergence_of(df_arm: pd.DataFrame, **params) -> det.Detection | None:
    """``detectors.diverged`` on the arm's loss and grad norm (None when either tag is absent)."""
    loss_steps, loss = series(df_arm, tags.LOSS)
    gn_steps, gn = series(df_arm, tags.GRAD_NORM)
    if loss.size == 0 or gn.size == 0:
        return None
    return det.diverged(loss_steps, loss, gn_steps, gn, **params)


def max_logit_series(df_arm: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, str]:
    """Max attention logit over layers: the logged ``attn/max_logit``, else the max of the
    per-layer tags at each step (NaN at a step where a layer's is NaN: pandas' max would skip
    it). Returns ``(steps_N, values_N, source)``; empty if neither."""
    steps, values = series(df_arm, tags.MAX_LOGIT)
    if values.size:
        return steps, values, tags.MAX_LOGIT
    per_layer = layer_tags(df_arm["tag"].unique(), tags.MAX_LOGIT_LAYER)
    if not per_layer:
        return steps, values, ""
    sel = df_arm[df_arm["tag"].isin(per_layer.values())]
    by_step = sel.groupby("step", sort=True)["value"].max()
    by_step[sel["value"].isna().groupby(sel["step"], sort=True).any()] = np.nan
    return by_step.index.to_numpy(np.int64), by_step.to_numpy(np.float64), MAX_OVER_LAYERS


def _precursors(df_arm: pd.DataFrame) -> list[tuple[str, str, Callable, np.ndarray, np.ndarray]]:
    """(precursor name, tag, detector, steps, values) for every precursor the arm has data for."""
    out = []
    loss_steps, loss = series(df_arm, tags.LOSS)
    gn_steps, gn = series(df_arm, tags.GRAD_NORM)
    if gn.size:
        out.append(("grad_ratio", tags.GRAD_NORM, det.grad_explosion_ratio, gn_steps, gn))
        out.append(("grad_zscore", tags.GRAD_NORM, det.grad_explosion_zscore, gn_steps, gn))
        out.append(("grad_sigma", tags.GRAD_NORM, det.rolling_sigma, gn_steps, gn))
    if loss.size:
        out.append(("loss_sigma", tags.LOSS, det.rolling_sigma, loss_steps, loss))
        out.append(("loss_divergence", tags.LOSS, det.loss_divergence, loss_steps, loss))
    names = df_arm["tag"].unique()
    for i, tag in layer_tags(names, tags.MAX_LOGIT_LAYER).items():
        out.append((f"logit_runaway/layer_{i}", tag, det.logit_runaway, *series(df_arm, tag)))
    m_steps, m_values, source = max_logit_series(df_arm)
    if m_values.size:
        out.append(("logit_runaway/max", source, det.logit_runaway, m_steps, m_values))
    for i, tag in layer_tags(names, tags.JACOBIAN_LAYER).items():
        out.append((f"jacobian_growth/layer_{i}", tag, det.jacobian_growth, *series(df_arm, tag)))
    return out


def early_warning(
    df_arm: pd.DataFrame, divergence_step: int | None | Literal["detect"] = "detect"
) -> pd.DataFrame:
    """One row per precursor (columns ``COLUMNS``) for one run arm.

    ``divergence_step``: ``"detect"`` (default) runs ``detectors.diverged`` on the arm's loss
    and grad norm; an int or None (no divergence) takes the trainer's verdict from summary.json
    instead. ``step`` is None where the precursor never fired; ``lead_steps`` is None then, or
    when there was no divergence.
    """
    if df_arm.empty:
        raise ValueError("early_warning got an empty frame (no scalars for this arm)")
    if isinstance(divergence_step, str):
        if divergence_step != "detect":
            raise ValueError(
                f"divergence_step must be an int, None or 'detect', got {divergence_step!r}"
            )
        found = divergence_of(df_arm)
        divergence_step = found.step if found is not None else None
    rows = []
    for name, tag, fn, steps, values in _precursors(df_arm):
        hit = fn(steps, values)
        step = hit.step if hit is not None else None
        lead = divergence_step - step if step is not None and divergence_step is not None else None
        rows.append(
            {
                "precursor": name,
                "tag": tag,
                "detector": fn.__name__,
                "step": step,
                "value": hit.value if hit is not None else float("nan"),
                "divergence_step": divergence_step,
                "lead_steps": lead,
                "detail": hit.detail if hit is not None else "",
            }
        )
    out = pd.DataFrame(rows, columns=COLUMNS)
    return out.astype(
        {"step": "Int64", "value": "float64", "divergence_step": "Int64", "lead_steps": "Int64"}
    )


def first_warning(table: pd.DataFrame, skip: Collection[str] = ()) -> tuple[str | None, int | None]:
    """The precursor that fired first at or before the divergence, and its lead (steps).

    ``skip``: precursors not to name (``rates.warning_rates`` finds those that fire on too many
    stable runs to mean anything).
    """
    ahead = table[table["lead_steps"].notna() & (table["lead_steps"] >= 0)]
    ahead = ahead[~ahead["precursor"].isin(list(skip))]
    if ahead.empty:
        return None, None
    best = ahead.sort_values(["lead_steps", "precursor"], ascending=[False, True]).iloc[0]
    return str(best["precursor"]), int(best["lead_steps"])
