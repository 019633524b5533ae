"""Outcome rates over repeated runs: how often an arm diverged, with a 95% interval, and how
each early-warning precursor did across the repeats (lead on the runs that diverged, false
alarms on the runs that did not).

Repeats are found by their resolved config, not by their names: arm dirs form one *group* when
they have the same arm and the same setting (``settings``: the config keys in which the runs
differ, seed, names and bookkeeping aside). So K seeds of one setting pool into one group, and
so do K runs of one seed (a nondeterministic backend, e.g. SDPA's backward); run dirs written by
``experiments/sweep.py --repeats K`` and hand-named ones group the same way.

Each group's diverged runs are also counted per failure mechanism (``mechanism``: logit growth,
early transient, other, unknown), so an early transient is not read as the logit-growth failure.

Rates count finished runs only (status ``stable`` or ``diverged``); an interrupted or
unfinished run has no outcome yet and is counted apart (``n_unfinished``).

Wilson score interval for k of n (z = 1.96 for 95%), with p = k / n:

    centre = (p + z^2 / 2n) / (1 + z^2 / n)
    half   = z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n)

It stays inside [0, 1] and does not collapse to a point at k = 0 or k = n as the normal (Wald)
interval does: 0 diverged in 5 runs is still compatible with a rate up to 43%.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd

from stabilitylab.analysis.early_warning import first_warning
from stabilitylab.analysis.events import load_config
from stabilitylab.analysis.mechanism import mechanism_counts
from stabilitylab.analysis.settings import flatten, varying_keys

Z_95 = 1.96
FINISHED = ("stable", "diverged")
FALSE_ALARM_MAX = 0.2
"""A precursor that fires on more than this fraction of an arm's stable runs is not named as a
first warning for that arm: it fires whether or not the run is about to diverge."""

RATE_COLUMNS = [
    "group", "n_runs", "n_diverged", "diverged", "fraction_diverged", "ci_low", "ci_high",
    "median_divergence_step", "min_divergence_step", "max_divergence_step", "n_unfinished",
    "first_warning",
]  # fmt: skip
WARNING_RATE_COLUMNS = [
    "group", "precursor", "n_diverged", "n_warned", "median_lead", "min_lead", "max_lead",
    "n_stable", "n_false_alarm", "false_alarm_rate", "fa_ci_low", "fa_ci_high",
    "false_alarm_basis", "named",
]  # fmt: skip
Key = tuple[str, str]  # (run, arm)


def wilson_interval(k: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """``(low, high)``: the Wilson score interval of a proportion, ``k`` successes in ``n``."""
    for name, v in (("k", k), ("n", n)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"wilson_interval: {name} must be an integer count, got {v!r}")
    if n < 1:
        raise ValueError(f"wilson_interval: n must be >= 1 (no trials, no interval), got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"wilson_interval: k must be in [0, n] = [0, {n}], got {k}")
    if not (math.isfinite(z) and z > 0):
        raise ValueError(f"wilson_interval: z must be positive and finite, got {z}")
    p, z2 = k / n, z * z
    denom = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # At k = 0 (k = n) the bound is exactly 0 (1); rounding would leave +-1e-17.
    low = 0.0 if k == 0 else max(0.0, centre - half)
    high = 1.0 if k == n else min(1.0, centre + half)
    return low, high


def _interval(k: int, n: int) -> tuple[float, float]:
    return wilson_interval(k, n) if n else (math.nan, math.nan)


def run_groups(found: list[tuple[Path, str, str]]) -> tuple[dict[Key, str], pd.DataFrame]:
    """``{(run, arm): group}`` for the arm dirs ``found`` (``events.discover``'s list), and the
    settings table (``setting`` id, then the config keys that tell the settings apart).

    group = the arm, followed by the setting id (``softmax S2``) when the runs hold more than
    one setting. An arm dir without config.json cannot be matched: it is a group of its own,
    ``<run>/<arm>``.
    """
    configs = {(run, arm): load_config(d) for d, run, arm in found}
    keys = varying_keys([c for c in configs.values() if c is not None])
    ids: dict[tuple, str] = {}
    rows, setting_of = [], {}
    for key, config in configs.items():
        if config is None:
            continue
        flat = flatten(config)
        values = tuple(repr(flat.get(k)) for k in keys)
        if values not in ids:
            ids[values] = f"S{len(ids) + 1}"
            rows.append({"setting": ids[values], **{k: flat.get(k) for k in keys}})
        setting_of[key] = ids[values]
    groups = {}
    for run, arm in configs:
        setting = setting_of.get((run, arm))
        if setting is None:
            groups[(run, arm)] = f"{run}/{arm}"
        else:
            groups[(run, arm)] = f"{arm} {setting}" if len(ids) > 1 else arm
    return groups, pd.DataFrame(rows, columns=["setting", *keys])


def has_repeats(groups: dict[Key, str]) -> bool:
    """Whether any group holds more than one run."""
    return any(c > 1 for c in Counter(groups.values()).values())


def _grouped(table: pd.DataFrame, groups: dict[Key, str]) -> pd.DataFrame:
    missing = [k for k in zip(table["run"], table["arm"], strict=True) if k not in groups]
    if missing:
        raise ValueError(f"no group for (run, arm) {missing[0]}")
    return table.assign(group=[groups[k] for k in zip(table["run"], table["arm"], strict=True)])


def outcome_rates(summary: pd.DataFrame, groups: dict[Key, str]) -> pd.DataFrame:
    """Per group (columns ``RATE_COLUMNS``): finished runs, how many diverged, the fraction with
    its 95% Wilson interval, the median / min / max divergence step, unfinished runs, and the
    first warning named most often on the group's diverged runs (``"name (k of n)"``).
    ``diverged`` spells the count out with the failures per mechanism,
    ``"3/4 (logit growth 2, early transient 1)"`` (``mechanism``; just ``"3/4"`` when the table
    has no ``mechanism`` column or no run diverged).

    ``summary``: the report's per-run table (run, arm, status, divergence_step, first_warning,
    and optionally mechanism).
    """
    rows = []
    for group, g in _grouped(summary, groups).groupby("group", sort=False):
        done = g[g["status"].isin(FINISHED)]
        div = done[done["status"] == "diverged"]
        n, k = len(done), len(div)
        low, high = _interval(k, n)
        steps = div["divergence_step"].dropna().astype(int).to_numpy()
        counts = sorted(Counter(div["first_warning"].dropna()).items(), key=lambda c: (-c[1], c[0]))
        rows.append(
            {
                "group": group,
                "n_runs": n,
                "n_diverged": k,
                "diverged": _diverged_text(div, n),
                "fraction_diverged": k / n if n else math.nan,
                "ci_low": low,
                "ci_high": high,
                "median_divergence_step": float(np.median(steps)) if steps.size else math.nan,
                "min_divergence_step": int(steps.min()) if steps.size else None,
                "max_divergence_step": int(steps.max()) if steps.size else None,
                "n_unfinished": len(g) - n,
                "first_warning": f"{counts[0][0]} ({counts[0][1]} of {k})" if counts else None,
            }
        )
    out = pd.DataFrame(rows, columns=RATE_COLUMNS)
    return out.astype({"min_divergence_step": "Int64", "max_divergence_step": "Int64"})


def _diverged_text(div: pd.DataFrame, n: int) -> str:
    """``"k/n"``, with the diverged runs counted per mechanism in brackets when known."""
    text = f"{len(div)}/{n}"
    counts = mechanism_counts(div["mechanism"]) if "mechanism" in div.columns else None
    return f"{text} ({counts})" if counts else text


def _with_status(early: pd.DataFrame, summary: pd.DataFrame, groups) -> pd.DataFrame:
    status = dict(zip(zip(summary["run"], summary["arm"], strict=True), summary["status"],
                      strict=True))  # fmt: skip
    keys = list(zip(early["run"], early["arm"], strict=True))
    return _grouped(early, groups).assign(status=[status.get(k) for k in keys])


def warning_rates(
    early: pd.DataFrame,
    summary: pd.DataFrame,
    groups: dict[Key, str],
    threshold: float = FALSE_ALARM_MAX,
) -> pd.DataFrame:
    """Per group and precursor (columns ``WARNING_RATE_COLUMNS``), over the runs with its data.

    Diverged runs: how many it warned (fired at or before the divergence) and the lead in steps
    (median, min, max over those). Stable runs: how many it fired on at all, the rate and its
    Wilson interval. ``false_alarm_basis`` says which stable runs: ``arm`` (the group's own);
    ``all stable runs`` of the report where the group has none; ``-`` where there are none at
    all (nothing to judge by). ``named``: false-alarm rate <= ``threshold`` (or unknown); a
    precursor not named is left out of the first-warning columns.

    ``early``: the report's early-warning rows (run, arm, precursor, step, lead_steps);
    ``summary``: its per-run table (run, arm, status).
    """
    e = _with_status(early, summary, groups)
    stable_all = e[e["status"] == "stable"]
    rows = []
    for (group, precursor), g in e.groupby(["group", "precursor"], sort=False):
        div = g[g["status"] == "diverged"]
        leads = div["lead_steps"].dropna()
        leads = leads[leads >= 0].astype(int).to_numpy()
        stable, basis = g[g["status"] == "stable"], "arm"
        if stable.empty:
            stable = stable_all[stable_all["precursor"] == precursor]
            basis = "all stable runs" if not stable.empty else "-"
        n_s, k_s = len(stable), int(stable["step"].notna().sum())
        rate = k_s / n_s if n_s else math.nan
        low, high = _interval(k_s, n_s)
        rows.append(
            {
                "group": group,
                "precursor": precursor,
                "n_diverged": len(div),
                "n_warned": int(leads.size),
                "median_lead": float(np.median(leads)) if leads.size else math.nan,
                "min_lead": int(leads.min()) if leads.size else None,
                "max_lead": int(leads.max()) if leads.size else None,
                "n_stable": n_s,
                "n_false_alarm": k_s,
                "false_alarm_rate": rate,
                "fa_ci_low": low,
                "fa_ci_high": high,
                "false_alarm_basis": basis,
                "named": not rate > threshold,
            }
        )
    out = pd.DataFrame(rows, columns=WARNING_RATE_COLUMNS)
    return out.astype({"min_lead": "Int64", "max_lead": "Int64", "named": bool})


def skipped_precursors(warn_rates: pd.DataFrame) -> dict[str, set[str]]:
    """``{group: precursors not to name as its first warning}`` (``named`` false)."""
    noisy = warn_rates[~warn_rates["named"].astype(bool)]
    return {g: set(d["precursor"]) for g, d in noisy.groupby("group", sort=False)}


def filter_first_warnings(
    summary: pd.DataFrame, early: pd.DataFrame, groups: dict[Key, str], warn_rates: pd.DataFrame
) -> pd.DataFrame:
    """``summary`` with ``first_warning`` / ``lead_steps`` chosen again per run, leaving out the
    precursors that ``warning_rates`` did not name for the run's group."""
    skip = skipped_precursors(warn_rates)
    out = summary.copy()
    for i, (run, arm) in enumerate(zip(out["run"], out["arm"], strict=True)):
        table = early[(early["run"] == run) & (early["arm"] == arm)]
        if table.empty:
            continue
        name, lead = first_warning(table, skip.get(groups[(run, arm)], ()))
        out.iloc[i, out.columns.get_loc("first_warning")] = name
        out.iloc[i, out.columns.get_loc("lead_steps")] = pd.NA if lead is None else lead
    return out
