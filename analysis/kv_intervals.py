"""Every PPL difference the KV study states, with its paired bootstrap 95% interval.

    table = comparisons(windows)     # windows: the study's per-window NLL (study.windows_table)

Computed from the per-window records alone, so studies of disjoint cells (one process per pair
on a GPU) compare across processes once merged (softmax vs sigmoid sit in different pairs). Each
row is ``a - b`` on the windows both were scored on (``analysis.intervals``): a negative
difference means ``a`` has the lower perplexity. ``verdict``: ``a better`` / ``b better`` when
the interval excludes 0, else ``undecided``.

Per text (test, held-out) and gated cell ``g`` with dense backbone ``d``:

- ``tau0 gap``: ``g`` at tau = 0 (nothing evicted) vs ``d``: what training with gates cost;
- ``eviction cost``: ``g`` at tau* vs ``g`` at tau = 0: what the gate's own eviction cost;
- ``gate vs dense``: ``g`` at tau* vs ``d``;
- ``gate vs <baseline>``: ``g`` at tau* vs the baseline on ``d`` at ``g``'s matched budget;
- ``fine-tune vs scratch``: an ``-ft`` cell vs the gated cell trained from scratch, at tau = 0
  and at tau*;

and per dense-or-gated cell pair differing only in attention: ``sigmoid vs softmax`` with
nothing evicted.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from stabilitylab.analysis.intervals import N_BOOT, paired_ppl_difference, ppl
from stabilitylab.config import FT_SUFFIX, backbone_of

COLUMNS = [
    "text", "comparison", "a", "b", "ppl_a", "ppl_b", "diff", "lo", "hi", "verdict", "n_windows",
]  # fmt: skip
FIXED_ROLES = ("dense", "tau_star", "sweep")
VERDICT = {"a < b": "a better", "a > b": "b better", "undecided": "undecided"}


def _series(windows: pd.DataFrame) -> dict[tuple[str, str, str], pd.DataFrame]:
    """``(text, cell, role)`` -> that evaluation's windows (nll, tokens) indexed by window."""
    rows = windows[windows["role"] != "sweep"]
    return {
        key: g.set_index("window")[["nll", "tokens"]]
        for key, g in rows.groupby(["text", "cell", "role"], sort=False)
    }


def compare(series, text, kind, a, b, n_boot=N_BOOT) -> dict | None:
    """One row: ``a - b`` (each a ``(cell, role)``) on their shared windows, or None if either
    was not evaluated on ``text``."""
    sa, sb = series.get((text, *a)), series.get((text, *b))
    if sa is None or sb is None:
        return None
    both = sa.join(sb, lsuffix="_a", rsuffix="_b", how="inner")
    if both.empty:
        return None
    tok = both["tokens_a"].to_numpy(np.float64)
    iv = paired_ppl_difference(
        both["nll_a"].to_numpy(), both["nll_b"].to_numpy(), tok, n_boot=n_boot
    )
    return {
        "text": text, "comparison": kind, "a": _label(a), "b": _label(b),
        "ppl_a": ppl(both["nll_a"].to_numpy(), tok), "ppl_b": ppl(both["nll_b"].to_numpy(), tok),
        "diff": iv.estimate, "lo": iv.lo, "hi": iv.hi, "verdict": VERDICT[iv.verdict],
        "n_windows": len(both),
    }  # fmt: skip


def _label(key: tuple[str, str]) -> str:
    cell, role = key
    if role == "dense":
        return f"{cell} (tau=0)" if "-g-" in cell else cell
    if role == "tau_star":
        return f"{cell} (tau*)"
    return f"{role} on {backbone_of(cell)} (matched to {cell})"


def _gated_pairs(text: str, cell: str, roles: set[str], cells: set[str]) -> list[tuple]:
    d = backbone_of(cell)
    pairs = [
        ("tau0 gap", (cell, "dense"), (d, "dense")),
        ("eviction cost", (cell, "tau_star"), (cell, "dense")),
        ("gate vs dense", (cell, "tau_star"), (d, "dense")),
    ]
    pairs += [
        (f"gate vs {r}", (cell, "tau_star"), (cell, r)) for r in sorted(roles - set(FIXED_ROLES))
    ]
    scratch = cell.removesuffix(FT_SUFFIX)
    if scratch != cell and scratch in cells:
        pairs += [
            ("fine-tune vs scratch", (cell, "dense"), (scratch, "dense")),
            ("fine-tune vs scratch", (cell, "tau_star"), (scratch, "tau_star")),
        ]
    return pairs


def comparisons(windows: pd.DataFrame, n_boot: int = N_BOOT) -> pd.DataFrame:
    """Every comparison the module docstring lists, over the texts ``windows`` holds (not val)."""
    if windows is None or windows.empty:
        return pd.DataFrame(columns=COLUMNS)
    series = _series(windows)
    rows = []
    for text in [t for t in dict.fromkeys(windows["text"]) if t != "val"]:
        here = windows[windows["text"] == text]
        cells = set(here["cell"])
        for cell in dict.fromkeys(here.loc[here["role"] == "tau_star", "cell"]):
            roles = set(here.loc[here["cell"] == cell, "role"])
            for kind, a, b in _gated_pairs(text, cell, roles, cells):
                rows.append(compare(series, text, kind, a, b, n_boot))
        for cell in sorted(c for c in cells if c.startswith("sig-")):
            other = "sm-" + cell.removeprefix("sig-")
            rows.append(compare(series, text, "sigmoid vs softmax", (cell, "dense"), (other, "dense"), n_boot))  # fmt: skip
    rows = [r for r in rows if r is not None]
    return pd.DataFrame(rows, columns=COLUMNS)


def seed_comparisons(per_seed: pd.DataFrame) -> pd.DataFrame:
    """Comparisons of several seeds (``per_seed``: comparison tables with a ``run`` column):
    per (text, comparison, a, b), the mean difference over seeds with its t interval, and how
    many seeds' own intervals decided which way."""
    from stabilitylab.analysis.intervals import seed_interval

    out = []
    for key, g in per_seed.groupby(["text", "comparison", "a", "b"], sort=False):
        iv = seed_interval(g["diff"])
        out.append(
            {
                "text": key[0], "comparison": key[1], "a": key[2], "b": key[3],
                "seeds": g["run"].nunique(), "mean_diff": iv.estimate, "lo": iv.lo, "hi": iv.hi,
                "verdict": VERDICT[iv.verdict] if g["run"].nunique() > 1 else "one seed",
                "a_better_seeds": int((g["verdict"] == "a better").sum()),
                "b_better_seeds": int((g["verdict"] == "b better").sum()),
                "per_seed": " ".join(f"{d:+.3g}" if math.isfinite(d) else "nan" for d in g["diff"]),
            }
        )  # fmt: skip
    return pd.DataFrame(out)
