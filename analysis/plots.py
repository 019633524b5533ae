"""Figures: training curves like the paper's Figure 6, a per-layer max-logit heatmap, and the
repeats of a report pooled by group.

Agg backend (no display needed). Non-finite points are dropped from the lines (a log axis
cannot show them); the divergence line marks where they began. A missing tag leaves its panel
with a note instead of failing, and the note is returned for the report.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from stabilitylab import tags  # noqa: E402
from stabilitylab.analysis.events import arms, layer_tags, select  # noqa: E402

_LAYER0_LOGIT = tags.layer(tags.MAX_LOGIT_LAYER, 0)
PANELS = [
    (tags.LOSS, "loss (nats)", False),
    (tags.GRAD_NORM, "global grad norm", True),
    (_LAYER0_LOGIT, "layer-0 max attention logit", True),
]


def arm_label(run: str, arm: str, runs: set[str]) -> str:
    return arm if len(runs) == 1 else f"{run}/{arm}"


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def curves_figure(
    df: pd.DataFrame, divergence: dict[tuple[str, str], int | None], path: str | Path
) -> list[str]:
    """Three panels (loss; grad norm, log y; layer-0 max logit, log y), one colour per arm.

    ``divergence`` maps (run, arm) to the divergence step (vertical dashed line) or None.
    Returns notes on panels left empty.
    """
    pairs = arms(df)
    runs = {r for r, _ in pairs}
    labels = {p: arm_label(*p, runs) for p in pairs}
    palette = dict(zip(labels.values(), sns.color_palette("tab10", len(pairs)), strict=True))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.2 * len(PANELS), 4.0), squeeze=False)
    notes = []
    for ax, (tag, title, log_y) in zip(axes[0], PANELS, strict=True):
        sel = df[(df["tag"] == tag) & np.isfinite(df["value"])]
        if log_y:
            sel = sel[sel["value"] > 0]
        if sel.empty:
            note = f"no finite data for {tag}: panel '{title}' skipped"
            notes.append(note)
            _note(ax, note)
            ax.set_title(title)
            continue
        sel = sel.assign(
            label=[labels[(r, a)] for r, a in zip(sel["run"], sel["arm"], strict=True)]
        )
        sns.lineplot(
            data=sel, x="step", y="value", hue="label", palette=palette, ax=ax,
            linewidth=1.0, estimator=None, errorbar=None,
        )  # fmt: skip
        for p in pairs:
            if divergence.get(p) is not None:
                ax.axvline(divergence[p], color=palette[labels[p]], linestyle="--", linewidth=1.0)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_ylabel(tag)
        ax.legend(title=None, fontsize=8)
    fig.suptitle("training curves (dashed: divergence step)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return notes


GROUP_PANELS = [
    (tags.LOSS, "loss (nats)", False),
    (tags.GRAD_NORM, "global grad norm", True),
    (tags.MAX_LOGIT, "max attention logit (all layers)", True),
]


def groups_figure(
    df: pd.DataFrame,
    groups: dict[tuple[str, str], str],
    divergence: dict[tuple[str, str], int | None],
    path: str | Path,
) -> list[str]:
    """Repeats pooled by group: one thin line per run in its group's colour, an x where a run
    diverged (its last finite point at or before the divergence step). Panels: loss; grad norm
    and the max attention logit over all layers, log y. Returns notes on panels left empty."""
    names = sorted(set(groups.values()))
    palette = dict(zip(names, sns.color_palette("tab10", len(names)), strict=True))
    counts = pd.Series(list(groups.values())).value_counts()
    fig, axes = plt.subplots(1, len(GROUP_PANELS), figsize=(5.2 * len(GROUP_PANELS), 4.0))
    notes = []
    for ax, (tag, title, log_y) in zip(np.atleast_1d(axes), GROUP_PANELS, strict=True):
        sel = df[(df["tag"] == tag) & np.isfinite(df["value"])]
        sel = sel[sel["value"] > 0] if log_y else sel
        if sel.empty:
            notes.append(f"no finite data for {tag}: panel '{title}' skipped")
            _note(ax, notes[-1])
            ax.set_title(title)
            continue
        for (run, arm), line in sel.groupby(["run", "arm"], sort=False):
            colour = palette.get(groups.get((run, arm)), "grey")
            ax.plot(line["step"], line["value"], color=colour, linewidth=0.8, alpha=0.8)
            step = divergence.get((run, arm))
            if step is not None and (line["step"] <= step).any():
                last = line[line["step"] <= step].iloc[-1]
                ax.plot(last["step"], last["value"], "x", color=colour, markersize=7, mew=1.6)
        if log_y:
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(tag)
    handles = [plt.Line2D([], [], color=palette[g], label=f"{g} (n={counts[g]})") for g in names]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(names), 6), fontsize=8)
    fig.suptitle("repeats by group (x: divergence)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return notes


def logit_heatmap(df: pd.DataFrame, path: str | Path) -> list[str]:
    """log10 of the per-layer max attention logit over steps, one panel per arm, one colour scale."""
    pairs = arms(df)
    runs = {r for r, _ in pairs}
    grids, notes = {}, []
    for run, arm in pairs:
        d = select(df, run, arm)
        per_layer = layer_tags(d["tag"].unique(), tags.MAX_LOGIT_LAYER)
        if not per_layer:
            notes.append(
                f"{arm_label(run, arm, runs)}: no per-layer max-logit telemetry, heatmap skipped"
            )
            continue
        sel = d[d["tag"].isin(per_layer.values())]
        layer_of = {t: i for i, t in per_layer.items()}
        grid = (
            sel.assign(layer=sel["tag"].map(layer_of))
            .pivot_table(index="layer", columns="step", values="value", aggfunc="max")
            .sort_index()
        )
        with np.errstate(divide="ignore", invalid="ignore"):
            grids[(run, arm)] = np.log10(grid.where(np.isfinite(grid) & (grid > 0)))
    finite = [g.to_numpy() for g in grids.values() if np.isfinite(g.to_numpy()).any()]
    vmin = min(float(np.nanmin(g)) for g in finite) if finite else None
    vmax = max(float(np.nanmax(g)) for g in finite) if finite else None

    panel_h = 1.6 + 0.3 * _max_layers(df)
    fig, axes = plt.subplots(len(pairs), 1, figsize=(10.0, panel_h * len(pairs)), squeeze=False)
    for ax, (run, arm) in zip(axes[:, 0], pairs, strict=True):
        label = arm_label(run, arm, runs)
        if (run, arm) not in grids:
            _note(ax, f"{label}: no per-layer max-logit telemetry")
            continue
        grid = grids[(run, arm)]
        sns.heatmap(
            grid, ax=ax, cmap="magma", vmin=vmin, vmax=vmax,
            cbar_kws={"label": "log10 max |logit|"}, xticklabels=max(1, grid.shape[1] // 12),
        )  # fmt: skip
        ax.set_title(f"{label}: per-layer max attention logit")
        ax.set_xlabel("step")
        ax.set_ylabel("layer")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return notes


def _max_layers(df: pd.DataFrame) -> int:
    return max(1, len(layer_tags(df["tag"].unique(), tags.MAX_LOGIT_LAYER)))
