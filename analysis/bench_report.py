"""Tables and kernel bars from the attention benchmark's rows (pure functions, no GPU).

``experiments/bench/bench_attention.py`` writes one row per (provider, D, T, pad, round) with
columns ``provider, D, T, pad, round, fwd_ms, bwd_ms, fwd_tflops, bwd_tflops``. Within a round
every provider is timed on the same shape one after another, so a per-round ratio compares two
kernels under the same conditions (clock, power cap, neighbours); the bars are medians of those
ratios.

Bars (T >= 4096, bf16): the op's forward and backward TFLOPS >= SDPA cuDNN's at each head dim, and
the op's TFLOPS with 25% padding within 10% of its unpadded figure; the softmax kernel's forward
and backward >= 0.9x cuDNN's, autotuned (``softmax-triton``) and deterministic
(``softmax-triton-det``, the configs train.deterministic pins), when the run timed them.
"""

from __future__ import annotations

import pandas as pd

OP, BASELINE = "sigmoid-triton", "cudnn"
BAR_MIN_T = 4096
PAD_BAR, PAD_TOLERANCE = 0.25, 0.10
SOFTMAX_OPS, SOFTMAX_THRESHOLD = ("softmax-triton", "softmax-triton-det"), 0.9


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per shape, one "fwd / bwd" column per provider: TFLOPS, median over rounds."""
    med = df.groupby(["provider", "D", "T", "pad"], sort=False, as_index=False)[
        ["fwd_tflops", "bwd_tflops"]
    ].median()
    cell = lambda r: f"{r.fwd_tflops:.0f} / {r.bwd_tflops:.0f}".replace("nan", "-")
    wide = med.assign(cell=med.apply(cell, axis=1), pad_pct=(med["pad"] * 100).round().astype(int))
    return wide.pivot_table(
        index=["D", "T", "pad_pct"], columns="provider", values="cell", aggfunc="first"
    )[list(dict.fromkeys(df.provider))].reset_index()


def _per_round(df: pd.DataFrame, provider: str, pad: float) -> pd.DataFrame:
    rows = df[(df["provider"] == provider) & (df["pad"] == pad) & (df["T"] >= BAR_MIN_T)]
    return rows.set_index(["D", "T", "round"])[["fwd_tflops", "bwd_tflops"]]


def _status(passing: int, rounds: int, median_passes: bool) -> str:
    """``met`` when every round passes, ``tie`` when only the median does, else ``not met``."""
    if passing == rounds:
        return "met"
    return "tie" if median_passes else "not met"


def _ratio_row(name: str, D: int, T: int, num: pd.Series, den: pd.Series, threshold: float) -> dict:
    """Per-round ratios ``num / den``. A round without a reference figure (``den`` NaN) is left
    out; a round where the op itself failed (``num`` NaN) counts as a ratio of 0, a failing round."""
    den = den.reindex(num.index)
    keep = den.notna()
    ratios = (num[keep].fillna(0.0) / den[keep]).astype(float)
    if ratios.empty:
        return {"bar": name, "D": D, "T": T, "rounds": 0, "median": float("nan"),
                "low": float("nan"), "high": float("nan"), "rounds_passing": 0,
                "status": "no data"}  # fmt: skip
    median, passing = float(ratios.median()), int((ratios >= threshold).sum())
    status = _status(passing, len(ratios), median >= threshold)
    return {
        "bar": name, "D": D, "T": T, "rounds": len(ratios), "median": median,
        "low": float(ratios.min()), "high": float(ratios.max()),
        "rounds_passing": passing, "status": status,
    }  # fmt: skip


def bars(df: pd.DataFrame) -> pd.DataFrame:
    """The kernel bars from one run: medians (and ranges) of per-round ratios.

    Rows: ``fwd vs cudnn`` / ``bwd vs cudnn`` (op / cuDNN TFLOPS, unpadded; threshold 1),
    ``fwd 25% pad`` / ``bwd 25% pad`` (op padded / op unpadded TFLOPS; threshold 0.9), and
    ``<softmax op> fwd|bwd vs cudnn`` (threshold 0.9), for every head dim and every T >= 4096
    present in ``df``. Status: ``met`` when every round reaches the
    threshold, ``tie`` when the median does but some round does not, ``not met`` when the median
    does not. A round whose reference figure is missing is left out; a round where the op
    failed counts as failing. A bar whose providers or shapes are missing from ``df`` is left out.
    """
    rows = []
    op0, base0 = _per_round(df, OP, 0.0), _per_round(df, BASELINE, 0.0)
    op_pad = _per_round(df, OP, PAD_BAR)
    base_shapes, pad_shapes = (set(t.index.droplevel("round")) for t in (base0, op_pad))
    for (D, T), op in op0.groupby(level=["D", "T"]):
        op = op.droplevel(["D", "T"])  # indexed by round
        for kind in ("fwd", "bwd"):
            col = f"{kind}_tflops"
            if (D, T) in base_shapes:
                base = base0.loc[(D, T)][col]
                rows.append(_ratio_row(f"{kind} vs {BASELINE}", D, T, op[col], base, 1.0))
            if (D, T) in pad_shapes:
                padded, threshold = op_pad.loc[(D, T)][col], 1.0 - PAD_TOLERANCE
                rows.append(_ratio_row(f"{kind} 25% pad", D, T, padded, op[col], threshold))
    rows += _softmax_rows(df, base0)
    columns = ["bar", "D", "T", "rounds", "median", "low", "high", "rounds_passing", "status"]
    out = pd.DataFrame(rows, columns=columns)
    bar_names = [f"fwd vs {BASELINE}", f"bwd vs {BASELINE}", "fwd 25% pad", "bwd 25% pad"]
    bar_names += [f"{op} {kind} vs {BASELINE}" for op in SOFTMAX_OPS for kind in ("fwd", "bwd")]
    order = {name: i for i, name in enumerate(bar_names)}
    out = out.sort_values(["bar", "D", "T"], key=lambda c: c.map(order) if c.name == "bar" else c)
    return out.reset_index(drop=True)


def _softmax_rows(df: pd.DataFrame, base0: pd.DataFrame) -> list[dict]:
    """``<softmax op> fwd|bwd vs cudnn`` rows (threshold ``SOFTMAX_THRESHOLD``), unpadded, for the
    softmax ops and shapes that ``df`` holds with a cuDNN figure."""
    rows = []
    base_shapes = set(base0.index.droplevel("round"))
    for name in SOFTMAX_OPS:
        for (D, T), op in _per_round(df, name, 0.0).groupby(level=["D", "T"]):
            if (D, T) not in base_shapes:
                continue
            op = op.droplevel(["D", "T"])
            for kind in ("fwd", "bwd"):
                col = f"{kind}_tflops"
                bar = f"{name} {kind} vs {BASELINE}"
                rows.append(
                    _ratio_row(bar, D, T, op[col], base0.loc[(D, T)][col], SOFTMAX_THRESHOLD)
                )
    return rows


def bars_markdown(table: pd.DataFrame) -> str:
    """The bars as a pipe table; ratios as signed per cent (op vs the reference figure)."""
    pct = lambda x: "-" if pd.isna(x) else f"{(x - 1) * 100:+.1f}%"
    lines = [
        "| bar | D | T | median ratio | range | rounds passing | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table.itertuples(index=False):
        lines.append(
            f"| {r.bar} | {r.D} | {r.T} | {pct(r.median)} | {pct(r.low)} .. {pct(r.high)} "
            f"| {r.rounds_passing} of {r.rounds} | {r.status} |"
        )
    return "\n".join(lines)


def markdown_table(df: pd.DataFrame) -> str:
    """Plain pipe table (no ``tabulate`` dependency); floats to one decimal."""
    fmt = lambda x: f"{x:.1f}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(fmt(x) for x in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def model_step_bar(df: pd.DataFrame) -> pd.DataFrame:
    """Per micro-batch: median step ms of each backend, and the step time of ``sigmoid-triton``
    against ``softmax`` in per cent, paired by round (median, low, high; negative is faster). The
    bar: ``met`` when every round is faster, ``tie`` when only the median is."""
    rows = []
    for mb, part in df.groupby("micro_batch"):
        by = part.pivot_table(index="round", columns="backend", values="step_ms")
        change = ((by["sigmoid-triton"] / by["softmax"] - 1) * 100).dropna()
        rows.append({
            "micro_batch": mb, "softmax_ms": float(by["softmax"].median()),
            "sigmoid_triton_ms": float(by["sigmoid-triton"].median()), "rounds": len(change),
            "change_pct_median": float(change.median()), "change_pct_low": float(change.min()),
            "change_pct_high": float(change.max()),
            "status": _status(int((change < 0).sum()), len(change), float(change.median()) < 0),
        })  # fmt: skip
    return pd.DataFrame(rows)
