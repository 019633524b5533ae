"""Figures of the KV-eviction study's probes, from the tables of ``probes.model_probes``.

- ``figure_perturbation``: the paper's Figure 2, relative perturbation of each layer's attention
  output under random support removal, one panel per removal fraction p (a row per protocol
  when the table holds both);
- ``figure_rowsum_binarization``: the paper's Figure 3, gate binarization per gate layer of the
  gated cells (left) and the row-sum CV per layer of every cell, length-normalised (middle, the
  headline) and raw (right; ``probes/rowsum.py`` says which is which);
- ``figure_gate_categories``: the paper's Table 4 as bars, mean gate per token category and
  gated cell.

Softmax cells are drawn in blues with solid lines, sigmoid cells in reds with dashed lines, one
marker per cell. Agg backend (no display needed); each function returns the path it wrote.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

MARKERS = "osD^vP*X"
LOG_SPAN = 100.0
"""A panel whose values span more than this factor is drawn on a log axis."""
KIND_STYLE = {"softmax": ("Blues", "-"), "sigmoid": ("Reds", "--")}


def _require(df: pd.DataFrame, columns: list[str], what: str) -> None:
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ValueError(f"{what}: the table lacks column(s) {missing}; has {list(df.columns)}")
    if df.empty:
        raise ValueError(f"{what}: the table is empty")


def cell_styles(df: pd.DataFrame) -> dict[str, dict]:
    """``cell -> plot kwargs`` (colour by kind, shade by cell, a marker each), in table order."""
    cells = list(dict.fromkeys(df["cell"]))
    kind_of = dict(zip(df["cell"], df["kind"], strict=False))
    styles = {}
    for kind, (cmap, linestyle) in KIND_STYLE.items():
        mine = [c for c in cells if kind_of[c] == kind]
        shades = plt.get_cmap(cmap)(np.linspace(0.55, 0.95, max(len(mine), 1)))
        for c, colour in zip(mine, shades, strict=False):
            styles[c] = dict(color=colour, linestyle=linestyle, label=f"{c} ({kind})")
    unknown = [c for c in cells if c not in styles]
    if unknown:
        raise ValueError(f"cells {unknown} have a kind other than {list(KIND_STYLE)}")
    for i, c in enumerate(cells):
        styles[c]["marker"] = MARKERS[i % len(MARKERS)]
    return styles


def _lines(ax, df: pd.DataFrame, y: str, styles: dict[str, dict]) -> None:
    for cell, g in df.groupby("cell", sort=False):
        g = g.sort_values("layer")
        ax.plot(g["layer"], g[y], markersize=4, linewidth=1.2, **styles[cell])
    ax.set_xticks(sorted(df["layer"].unique()))


def figure_perturbation(support_removal_df: pd.DataFrame, path: str | Path) -> Path:
    """Figure 2: perturbation (mean over sequences) per layer, a panel per p and protocol."""
    df = support_removal_df
    _require(df, ["cell", "kind", "layer", "p", "perturbation"], "figure_perturbation")
    if "protocol" not in df.columns:
        df = df.assign(protocol="")
    ps, protocols = sorted(df["p"].unique()), list(dict.fromkeys(df["protocol"]))
    styles = cell_styles(df)
    fig, axes = plt.subplots(
        len(protocols), len(ps), figsize=(4.2 * len(ps), 3.4 * len(protocols)),
        squeeze=False, sharex=True,
    )  # fmt: skip
    for r, protocol in enumerate(protocols):
        for c, p in enumerate(ps):
            ax = axes[r][c]
            panel = df[(df["protocol"] == protocol) & (df["p"] == p)]
            _lines(ax, panel, "perturbation", styles)
            values = panel["perturbation"][panel["perturbation"] > 0]
            if len(values) and values.max() > LOG_SPAN * values.min():
                ax.set_yscale("log")  # a layer near zero output makes the ratio huge
            ax.set_title(f"p = {p:g}" + (f", {protocol}" if protocol else ""))
            ax.set_xlabel("layer")
            ax.set_ylabel("||O~ - O||_F / ||O||_F")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("random support removal: relative change of each layer's attention output")
    return _save(fig, path)


def figure_rowsum_binarization(rowsum_binarization_df: pd.DataFrame, path: str | Path) -> Path:
    """Figure 3: binarization per gate layer (gated cells) and the two row-sum CVs per layer
    (all cells): ``row_sum_cv_norm`` (CV of r_i / n_i under sigmoid) and ``row_sum_cv_raw``."""
    df = rowsum_binarization_df
    columns = ["cell", "kind", "layer", "row_sum_cv_norm", "row_sum_cv_raw", "binarization"]
    _require(df, columns, "figure_rowsum_binarization")
    styles = cell_styles(df)
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15.0, 3.8))
    gated = df[np.isfinite(df["binarization"].astype(float))]
    if gated.empty:
        left.text(0.5, 0.5, "no gated cell", ha="center", va="center", transform=left.transAxes)
    else:
        _lines(left, gated, "binarization", styles)
        left.set_ylim(-0.02, 1.02)
    left.set(title="gate binarization (g < 0.05 or g > 0.95)", xlabel="layer emitting the gate")
    _lines(middle, df, "row_sum_cv_norm", styles)
    middle.set(title="row-sum CV, length-normalised (row_sum_cv_norm)", xlabel="layer",
               ylabel="CV_i of r_i / n_i (sigmoid), r_i (softmax)")  # fmt: skip
    _lines(right, df, "row_sum_cv_raw", styles)
    right.set(title="row-sum CV, raw (row_sum_cv_raw)", xlabel="layer",
              ylabel="std(r_i) / mean(r_i)")  # fmt: skip
    right.legend(fontsize=7)
    fig.suptitle("what lets soft gates approximate hard deletion")
    return _save(fig, path)


def figure_gate_categories(table4_df: pd.DataFrame, path: str | Path) -> Path:
    """Table 4 as grouped bars: mean gate per token category, one bar per gated cell (a category
    no token fell in has no bar)."""
    df = table4_df
    _require(df, ["cell", "category", "mean_gate"], "figure_gate_categories")
    categories, cells = list(dict.fromkeys(df["category"])), list(dict.fromkeys(df["cell"]))
    width = 0.8 / len(cells)
    fig, ax = plt.subplots(figsize=(1.4 * len(categories) + 2.0, 3.8))
    x = np.arange(len(categories))
    for i, cell in enumerate(cells):
        g = df[df["cell"] == cell].set_index("category").reindex(categories)
        ax.bar(x + (i - (len(cells) - 1) / 2) * width, g["mean_gate"], width, label=cell)
    ax.set_xticks(x, categories)
    ax.set(ylabel="mean gate", ylim=(0, 1.02), title="mean learned gate per token category")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
