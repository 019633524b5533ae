"""Per-arm numbers for the report and the sweep: initial/final loss, growth factors, status.

growth = max(v) / median(first ``n_early`` finite points)
final loss = mean of the last ``n_final`` logged points (non-finite if the run ended broken)
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from stabilitylab import tags
from stabilitylab.analysis import detectors as det
from stabilitylab.analysis import mechanism as mech
from stabilitylab.analysis.early_warning import (
    divergence_of,
    early_warning,
    first_warning,
    max_logit_series,
)
from stabilitylab.analysis.events import series

N_INITIAL = 5
N_FINAL = 5
N_EARLY = 10

SUMMARY_COLUMNS = [
    "run", "arm", "status", "divergence_step", "divergence_reason", "detected_step",
    "loss_blowup_step", "first_warning", "lead_steps", "max_grad_norm", "grad_norm_growth", "max_logit",
    "max_logit_growth", "mechanism", "logit_before_divergence", "logit_growth",
    "logit_lead_steps", "mechanism_detail", "initial_loss", "final_loss", "last_step",
]  # fmt: skip


def initial_mean(values_N: np.ndarray, n: int = N_INITIAL) -> float:
    """Mean of the first ``n`` finite points (NaN if none)."""
    finite = values_N[np.isfinite(values_N)]
    return float(finite[:n].mean()) if finite.size else math.nan


def final_mean(values_N: np.ndarray, n: int = N_FINAL) -> float:
    """Mean of the last ``n`` logged points; NaN/inf stay, a broken end is not hidden."""
    return float(values_N[-n:].mean()) if values_N.size else math.nan


def growth(
    values_N: np.ndarray, n_early: int = N_EARLY, *, keep_nonfinite: bool = False
) -> tuple[float, float]:
    """``(max, max / early median)`` over finite points; NaNs when there are none. With
    ``keep_nonfinite`` the max is over every point: NaN if one is NaN, inf if one is inf (the
    max logit: a head whose logits broke is data, not noise to skip)."""
    finite = values_N[np.isfinite(values_N)]
    if finite.size == 0 and not (keep_nonfinite and values_N.size):
        return math.nan, math.nan
    early = float(np.median(finite[:n_early])) if finite.size else math.nan
    peak = float(np.max(values_N) if keep_nonfinite else finite.max())
    return peak, (peak / early if early > 0 else math.nan)


def warmup_of(config: dict | None) -> int | None:
    """``train.warmup_steps`` of a resolved config.json (None when absent or not an int)."""
    train = (config or {}).get("train")
    warmup = train.get("warmup_steps") if isinstance(train, dict) else None
    return warmup if isinstance(warmup, int) and not isinstance(warmup, bool) else None


def mechanism_of(
    status: str, div_step: int | None, logit_steps, logit, warmup: int | None
) -> mech.Mechanism | None:
    """``mechanism.classify`` for one arm; None for a run with no outcome yet (neither stable
    nor diverged, and no divergence step)."""
    if div_step is None and status == "diverged":
        return mech.Mechanism(mech.UNKNOWN, reason="diverged, but no divergence step recorded")
    if div_step is None and status != "stable":
        return None
    return mech.classify(logit_steps, logit, div_step, warmup)


def arm_row(
    df_arm: pd.DataFrame, summary: dict | None, config: dict | None = None
) -> tuple[dict, pd.DataFrame]:
    """The report's row for one arm, and its early-warning table.

    Status and divergence step come from summary.json when the run finished writing one;
    ``detected_step`` is always recomputed from the event data with ``detectors.diverged``, so
    the two can be compared; ``loss_blowup_step`` is ``detectors.loss_blowup`` on the loss, a
    failure the grad-norm rule can miss. Without summary.json the status is ``diverged`` if the rule fires,
    else ``unfinished``. ``mechanism`` and the ``logit_*`` numbers are ``mechanism.classify`` at
    that divergence step, with the warmup from ``config`` (the arm's config.json).
    """
    run, arm = df_arm["run"].iloc[0], df_arm["arm"].iloc[0]
    found = divergence_of(df_arm)
    detected = found.step if found is not None else None
    if summary is not None:
        status = summary.get("status", "unknown")
        div_step = summary.get("divergence_step")
        reason = summary.get("divergence_reason")
    else:
        status = "diverged" if found is not None else "unfinished"
        div_step = detected
        reason = f"{found.detector}: {found.detail}" if found is not None else None
    warnings_table = early_warning(df_arm, divergence_step=div_step)
    warn_name, lead = first_warning(warnings_table)

    loss_steps, loss = series(df_arm, tags.LOSS)
    _, gn = series(df_arm, tags.GRAD_NORM)
    logit_steps, logit, _ = max_logit_series(df_arm)
    found_mech = mechanism_of(status, div_step, logit_steps, logit, warmup_of(config))
    max_gn, gn_growth = growth(gn) if gn.size else (None, None)
    max_logit, logit_growth = growth(logit, keep_nonfinite=True) if logit.size else (None, None)
    blowup = det.loss_blowup(loss_steps, loss) if loss.size else None
    row = {
        "run": run,
        "arm": arm,
        "status": status,
        "divergence_step": div_step,
        "divergence_reason": reason,
        "detected_step": detected,
        "loss_blowup_step": blowup.step if blowup is not None else None,
        "first_warning": warn_name,
        "lead_steps": lead,
        "max_grad_norm": max_gn,
        "grad_norm_growth": gn_growth,
        "max_logit": max_logit,
        "max_logit_growth": logit_growth,
        "mechanism": found_mech.label if found_mech else None,
        "logit_before_divergence": found_mech.logit_before if found_mech else math.nan,
        "logit_growth": found_mech.growth if found_mech else math.nan,
        "logit_lead_steps": found_mech.lead_steps if found_mech else None,
        "mechanism_detail": found_mech.reason if found_mech else None,
        "initial_loss": initial_mean(loss) if loss.size else None,
        "final_loss": final_mean(loss) if loss.size else None,
        "last_step": int(df_arm["step"].max()),
    }
    warnings_table.insert(0, "run", run)
    warnings_table.insert(1, "arm", arm)
    return row, warnings_table
