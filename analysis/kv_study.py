"""The KV-eviction study's report: tables as CSV and markdown, Figure 1, and study.md.

    paths = write_study(result, Path("runs/kv_tiny/study"))      # result: run_study(...)
    paths = write_study(result, out, extra_tables={"table4": df}, extra_figures={"fig2": png})

Files (``<run dir>/study/``): table1 / table2 / table5 / decode_speed as ``.csv`` (full
precision) and ``.md`` (4 significant digits), ``fig1_ppl_vs_compression.png`` and ``study.md``,
which stitches them with a line on what each one is. The diagnostics (table4, Figures 2-3) come
from elsewhere and join study.md through ``extra_tables`` / ``extra_figures``; without them the
section says they were not run. Figure 1 is drawn from the tables alone, so it can be redrawn
from the CSVs (:func:`ppl_vs_compression_figure`).
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from stabilitylab.analysis.markdown import table as md_table  # noqa: E402

FIG1 = "fig1_ppl_vs_compression.png"
CAPTIONS = {
    "table1": "Table 1: dense decode-window perplexity on test of every cell (gated cells at "
    "tau = 0, nothing evicted); train_val_ppl is the training's last validation pass "
    "(full-context forward, not the decode window).",
    "table2": "Table 2: each gated cell at its tau* (selected on validation, frozen, then run on "
    "test): compression and test PPL against its dense backbone and H2O / KeyDiff on that "
    "backbone at the matched final live-cache size per window and layer.",
    "table5": "Table 5: the validation sweep over the tau grid per gated cell (delta_ppl against "
    "the same model at tau = 0; compression over all layers, over the evictable layers, per "
    "layer); `selected` marks tau*.",
    "decode_speed": "Decode wall-clock on test at tau* against the same model at tau = 0: "
    "whole evaluation (prefill included) in the eager decode loop, synchronised on CUDA; "
    "decoded tokens per second and the final live K/V bytes per window. A measurement, not a "
    "benchmark of a fused kernel.",
}
PROBE_HOOK = "<!-- probe tables and figures (table4, fig2, fig3) join here: write_study(extra_tables=..., extra_figures=...) -->"  # fmt: skip


def write_table(df: pd.DataFrame, out_dir: Path, name: str) -> dict[str, Path]:
    """``name.csv`` and ``name.md`` of ``df`` under ``out_dir``."""
    csv, md = out_dir / f"{name}.csv", out_dir / f"{name}.md"
    df.to_csv(csv, index=False)
    md.write_text(md_table(df) + "\n")
    return {f"{name}.csv": csv, f"{name}.md": md}


# ---- Figure 1 ---------------------------------------------------------------------------------


def _panel(ax, sweep: pd.DataFrame, row: pd.Series | None, colour) -> None:
    """One gated cell: the validation sweep (line), tau* on it (star), its test point at tau*
    and the baselines' test points at the matched budget (markers), the backbone's test PPL
    (dashed)."""
    sweep = sweep.sort_values("compression")
    ax.plot(sweep["compression"], sweep["ppl"], "o-", color=colour, ms=3, lw=1, label="val sweep")
    star = sweep[sweep["selected"].astype(bool)]
    ax.plot(star["compression"], star["ppl"], "*", color=colour, ms=13, label="tau* (val)")
    if row is None:
        return
    ax.plot(row["test_compression"], row["test_ppl_tau_star"], "o", mfc="none", mec=colour,
            ms=9, mew=1.5, label="gate, test")  # fmt: skip
    for key, marker, label in (("h2o", "^", "H2O, test"), ("keydiff", "s", "KeyDiff, test")):
        if np.isfinite(row[f"{key}_test_ppl"]):
            ax.plot(row[f"{key}_compression"], row[f"{key}_test_ppl"], marker, color="0.3",
                    ms=7, label=label)  # fmt: skip
    if np.isfinite(row["backbone_test_ppl"]):
        ax.axhline(row["backbone_test_ppl"], color="0.5", ls="--", lw=1,
                   label=f"{row['backbone']} dense, test")  # fmt: skip


def ppl_vs_compression_figure(table5: pd.DataFrame, table2: pd.DataFrame, path: Path) -> Path:
    """Per gated cell, perplexity against compression (Figure 1). Validation and test share the
    axes but not the windows: the line is the validation sweep, the open markers are test."""
    cells = list(dict.fromkeys(table5["cell"])) if len(table5) else []
    n = max(1, len(cells))
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.0 * rows), squeeze=False)
    palette = sns.color_palette("tab10", n)
    by_cell = {r["cell"]: r for _, r in table2.iterrows()}
    for ax, cell, colour in zip(axes.flat, cells, palette, strict=False):
        _panel(ax, table5[table5["cell"] == cell], by_cell.get(cell), colour)
        ax.set_title(cell)
        ax.set_xlabel("compression (evicted / written, all layers)")
        ax.set_ylabel("decode-window perplexity")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(cells) :]:
        ax.axis("off")
    if not cells:
        axes[0, 0].text(0.5, 0.5, "no gated cell: nothing to sweep", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- study.md ---------------------------------------------------------------------------------


def _section(title: str, caption: str, body: str) -> list[str]:
    return [f"## {title}", "", caption, "", body, ""]


def study_markdown(
    tables: dict[str, pd.DataFrame],
    figures: dict[str, Path],
    out_dir: Path,
    extra_tables: dict[str, pd.DataFrame],
    extra_figures: dict[str, Path],
    header: str = "",
) -> str:
    """study.md's text: the eviction tables, Figure 1, then the diagnostics' hook."""
    lines = ["# KV-eviction study", ""]
    if header:
        lines += [header, ""]
    for name, df in tables.items():
        lines += _section(name, CAPTIONS.get(name, ""), md_table(df))
    for name, path in figures.items():
        lines += [f"## {name}", "", f"![{name}]({os.path.relpath(path, out_dir)})", ""]
    lines += ["## Diagnostics (table4, fig2, fig3)", "", PROBE_HOOK, ""]
    if not extra_tables and not extra_figures:
        lines += ["Not run with this report.", ""]
    for name, df in extra_tables.items():
        lines += _section(name, "", md_table(df))
    for name, path in extra_figures.items():
        lines += [f"### {name}", "", f"![{name}]({os.path.relpath(path, out_dir)})", ""]
    return "\n".join(lines)


def write_study(
    result,
    out_dir: Path,
    extra_tables: dict[str, pd.DataFrame] | None = None,
    extra_figures: dict[str, Path] | None = None,
    header: str = "",
) -> dict[str, Path]:
    """Every file of the study under ``out_dir`` (created); returns ``{file name: path}``.
    ``result``: a ``stabilitylab.eviction.study.StudyResult`` (anything with ``tables()``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    extra_tables, extra_figures = dict(extra_tables or {}), dict(extra_figures or {})
    missing = [f"{k}: {p}" for k, p in extra_figures.items() if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"extra figure(s) not found: {', '.join(missing)}")
    tables = result.tables()
    paths: dict[str, Path] = {}
    for name, df in {**tables, **extra_tables}.items():
        paths.update(write_table(df, out_dir, name))
    fig1 = ppl_vs_compression_figure(tables["table5"], tables["table2"], out_dir / FIG1)
    paths[FIG1] = fig1
    text = study_markdown(tables, {"fig1": fig1}, out_dir, extra_tables, extra_figures, header)
    paths["study.md"] = out_dir / "study.md"
    paths["study.md"].write_text(text)
    return paths


# ---- the study of one run ---------------------------------------------------------------------


def study_report(
    cfg,
    device: str | None = None,
    *,
    grid=None,
    progress: bool = False,
    extra_tables: dict[str, pd.DataFrame] | None = None,
    extra_figures: dict[str, Path] | None = None,
) -> dict[str, Path]:
    """Load ``cfg``'s trained cells (``<out_dir>/<name>/<cell>/``, the cells of ``cfg.cells``),
    run the eviction study on ``device`` (CUDA when visible) and write ``<run dir>/study/``.
    ``grid``: the tau grid (default ``TAU_GRID``)."""
    import torch

    from stabilitylab.eviction.cells import load_cells
    from stabilitylab.eviction.protocol import TAU_GRID
    from stabilitylab.eviction.study import run_study, study_inputs

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = Path(cfg.out_dir) / cfg.name
    cells = load_cells(run_dir, cfg.cells, device, expect=cfg)
    inputs = study_inputs(cfg, cells, grid=TAU_GRID if grid is None else grid, progress=progress)
    torch.manual_seed(cfg.study.seed)
    result = run_study(cells, inputs)
    d = inputs.decode
    header = (
        f"Run `{run_dir}` (preset {cfg.preset}), cells {', '.join(cells)}; decode window: prefill "
        f"{d.prefill} + {d.window} scored tokens; {len(inputs.val.indices(d, inputs.val_windows))} "
        f"validation and {len(inputs.test.indices(d, inputs.test_windows))} test windows; device "
        f"{device}; tau grid {list(inputs.grid)}."
    )
    return write_study(result, run_dir / "study", extra_tables, extra_figures, header)
