"""What a run's *setting* is: the resolved-config keys in which a set of runs differ.

Every config key whose value is not the same in all runs counts, except the arm, the seed and
bookkeeping (names, paths, cadences of telemetry and checkpoints). Runs of one arm and one
setting are repeats of each other: seeds pool, and so do reruns of one seed. The stability map
(``map``) and the outcome rates (``rates``) both group runs this way.
"""

from __future__ import annotations

import json

import pandas as pd

IGNORED_PREFIXES = ("name", "preset", "out_dir", "arm", "backend", "resume", "fresh", "report",
                    "allow_cpu", "trackers", "num_workers", "telemetry.", "train.seed",
                    "train.checkpoint_every")  # fmt: skip


def flatten(config: dict, prefix: str = "") -> dict:
    """``{"model": {"d_model": 512}}`` -> ``{"model.d_model": 512}``; lists become JSON text
    (hashable, so they can group runs)."""
    out = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = json.dumps(v) if isinstance(v, (list, tuple)) else v
    return out


def varying_keys(configs: list[dict]) -> list[str]:
    """Flattened keys whose values differ between ``configs`` (bookkeeping keys excluded)."""
    flat = [flatten(c) for c in configs]
    keys = sorted(set().union(*flat))
    keep = []
    for k in keys:
        if k.startswith(IGNORED_PREFIXES):
            continue
        values = {repr(f.get(k)) for f in flat}
        if len(values) > 1:
            keep.append(k)
    return keep


def with_setting_ids(runs: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``runs`` with a ``setting`` column (S1, S2, ... in row order) and the settings table."""
    if not keys:
        settings = pd.DataFrame({"setting": ["S1"]})
        return runs.assign(setting="S1"), settings
    settings = runs[keys].drop_duplicates().reset_index(drop=True)
    settings.insert(0, "setting", [f"S{i + 1}" for i in range(len(settings))])
    return runs.merge(settings, on=keys, how="left"), settings


ARM_OWN_KEYS = ("arm", "backend", "model.gates", "model.position")
"""What makes an arm itself: its name and backend; a KV cell also sets its gates and position."""


def arm_differences(configs: dict[str, dict]) -> dict[str, dict[str, object]]:
    """``{key: {arm: value}}`` for every training key in which the arms of ONE run differ
    beyond the arm itself (``ARM_OWN_KEYS``); the keys a resume may change freely
    (``stabilitylab.train.resume.FREE_KEYS``: steps, backends of the other arm, telemetry)
    do not count. A paired run whose arms differ compares more than the attention: e.g. one arm
    restarted alone with ``--fresh=True --arm sigmoid --train.lr=...``."""
    from stabilitylab.train.resume import FREE_KEYS, FREE_PREFIXES
    from stabilitylab.train.resume import flatten as flatten_config

    flat = {arm: flatten_config(c) for arm, c in configs.items() if c is not None}
    out = {}
    for key in sorted(set().union(*flat.values())) if flat else []:
        if key in ARM_OWN_KEYS or key in FREE_KEYS or key.startswith(FREE_PREFIXES):
            continue
        values = {arm: f.get(key, "<absent>") for arm, f in flat.items()}
        if len({repr(v) for v in values.values()}) > 1:
            out[key] = values
    return out
