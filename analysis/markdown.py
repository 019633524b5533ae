"""Markdown tables from DataFrames (no tabulate dependency)."""

from __future__ import annotations

import math

import pandas as pd


def fmt(v) -> str:
    """4 significant digits for floats (nan/inf spelled out), ``-`` for None, pipes escaped."""
    if v is None or v is pd.NA:
        return "-"
    if isinstance(v, float):
        return str(v) if not math.isfinite(v) else f"{v:.4g}"
    return str(v).replace("|", "\\|")


def table(df: pd.DataFrame) -> str:
    header = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "|" + "|".join("---" for _ in df.columns) + "|"
    body = ["| " + " | ".join(fmt(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([header, rule, *body])
