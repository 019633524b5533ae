"""The KV-eviction study's report: tables as CSV and markdown, figures, and study.md.

    paths = write_study(tables, Path("runs/kv_tiny/study"))   # tables: StudyResult.tables() + probes
    paths = time_study(cfg, Path("runs/kv_reduced/study"))    # decode_speed, timed in this process
    python analysis/kv_study.py --merge runs/kv_reduced/study-* --out runs/kv_reduced/study

Files (``<run dir>/study/`` or ``study.out_dir``): the eviction tables (table1, table2, table5,
decode_speed) and the diagnostics' (table4_categories, extreme_tokens, support_removal[_summary],
rowsum_binarization[_summary]) as ``.csv`` (full precision) and ``.md`` (4 significant digits);
Figure 1 (PPL vs compression), Figure 2 (support removal), Figure 3 (row-sum CV, binarization)
and the category bars; ``study.md`` stitches them with a line on what each is. Every figure is
drawn from the tables alone, so studies of disjoint cells (one process per pair of cells on a
GPU) join by concatenating their CSVs (``merge_studies``). Those processes do not time the decode
(``study.timing=False``); the parallel study's parent then times it alone on the device at the
tau* the joined table2 froze (``time_study``) and rewrites decode_speed and study.md.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from stabilitylab.analysis.kv_figures import (  # noqa: E402
    figure_gate_categories,
    figure_perturbation,
    figure_rowsum_binarization,
)
from stabilitylab.analysis.kv_intervals import comparisons  # noqa: E402
from stabilitylab.analysis.markdown import table as md_table  # noqa: E402

FIG1 = "fig1_ppl_vs_compression.png"
FIG2 = "fig2_support_removal.png"
FIG3 = "fig3_rowsum_binarization.png"
FIG4 = "fig4_gate_categories.png"
EVICTION_TABLES = ("table1", "table2", "table5", "sweep_test", "comparisons", "decode_speed")
WINDOWS = "windows"
"""Every evaluation's per-window NLL (``windows.csv.gz``; not drawn into study.md)."""
PROBE_TABLES = (
    "table4_categories", "extreme_tokens", "support_removal", "support_removal_summary",
    "rowsum_binarization", "rowsum_binarization_summary",
)  # fmt: skip
CAPTIONS = {
    "table1": "Table 1: decode-window perplexity of every cell with nothing evicted (gated cells at "
    "tau = 0), per text (test: the training corpus's test split; heldout: another corpus), with "
    "its bootstrap 95% interval over windows; train_val_ppl is the training's last validation "
    "pass (full-context forward); dead_gate_layers lists gate layers the training switched off.",
    "table2": "Table 2: each gated cell at its tau* (selected on validation by the rule, frozen, "
    "then run on each text): compression, PPL with its interval, against its dense backbone and "
    "the baselines on that backbone (h2o / keydiff: matched to the gate's live cache step by "
    "step; h2o_even: the gate's total spread evenly over layers; *_final: matched to the final "
    "size only); keys_read_frac = keys read over the decode / the dense backbone's.",
    "table5": "Table 5: the validation sweep over the tau grid per gated cell (delta to the same "
    "model at tau = 0, in PPL and ln PPL; compression over all layers, the evictable layers, per "
    "layer; keys read); `accepted` by the rule, `selected` marks tau*.",
    "sweep_test": "The tau grid on test, reported beside the frozen tau* (it selects nothing): "
    "PPL with its bootstrap interval, deltas to tau = 0, compression.",
    "comparisons": "Every PPL difference stated above, a - b on the same windows, with its paired "
    "bootstrap 95% interval; verdict `a better` / `b better` only where the interval excludes 0.",
    "decode_speed": "Decode wall-clock on test at tau* against the same model at tau = 0: "
    "whole evaluation (prefill included) in the eager decode loop, synchronised on CUDA; the "
    "median seconds of `repeats` alternating runs (min / max beside it), the speedup of the "
    "medians, decoded tokens per second and the final live K/V bytes per window. "
    "`measured_alone`: no other process of the study shared the device while it was timed (the "
    "parallel study times in its parent after every pair's process has ended). A measurement, "
    "not a benchmark of a fused kernel.",
    "table4_categories": "Table 4: mean gate per token category (GPT-2 pieces of the diagnostic "
    "windows) and gated cell.",
    "extreme_tokens": "The lowest- and highest-gate tokens per gated cell (tokens seen at least "
    "min_count times).",
    "support_removal": "Random support removal: relative change of each layer's attention output "
    "when a fraction p of the K/V positions (first four kept) is removed; `isolated`: that layer "
    "alone, `compound`: removal at every layer in a second forward pass (the paper's; Figure 2).",
    "support_removal_summary": "Support removal, mean over layers per cell and p (the paper, "
    "softmax / sigmoid: 0.574 / 0.579, 0.943 / 1.051, 1.131 / 3.666 at p = 0.1, 0.3, 0.5).",
    "rowsum_binarization": "Row-sum coefficient of variation across query positions per layer: "
    "`row_sum_cv_norm` of r_i / n_i (mean weight per visible key; the row length under "
    "b = -log L does not inflate it), `row_sum_cv_raw` of r_i itself (equal logits alone give "
    "0.576 at L = 512); 0 for softmax in both. For gated cells, gate binarization (fraction of "
    "gates < 0.05 or > 0.95) per gate layer (Figure 3).",
    "rowsum_binarization_summary": "Row-sum CVs (normalised, raw) and binarization, mean over "
    "layers per cell (the paper: row-sum CV 0.484 / 0.444, raw r_i, bias not stated; "
    "binarization 43.3% / 36.8% / 24.4%).",
}


NOT_TIMED = (
    "No row: no gated cell was timed here (none was studied, or study.timing=False, as in the "
    "parallel study's per-pair processes, whose parent times alone after they end)."
)


def write_table(df: pd.DataFrame, out_dir: Path, name: str) -> dict[str, Path]:
    """``name.csv`` and ``name.md`` of ``df`` under ``out_dir``."""
    csv, md = out_dir / f"{name}.csv", out_dir / f"{name}.md"
    df.to_csv(csv, index=False)
    md.write_text(md_table(df) + "\n")
    return {f"{name}.csv": csv, f"{name}.md": md}


# ---- Figure 1 ---------------------------------------------------------------------------------


BASELINE_MARKERS = (
    ("h2o", "^", "H2O (step-matched)"), ("keydiff", "s", "KeyDiff (step-matched)"),
    ("h2o_even", "v", "H2O (even over layers)"), ("h2o_final", "<", "H2O (final size)"),
    ("keydiff_final", ">", "KeyDiff (final size)"),
)  # fmt: skip


def _panel(ax, sweep: pd.DataFrame, test: pd.DataFrame, row: pd.Series | None, colour) -> None:
    """One gated cell: the validation sweep (line), tau* on it (star), the test grid (dotted),
    its test point at tau* with its interval and the baselines' test points at the matched
    budget (markers), the backbone's test PPL (dashed)."""
    sweep = sweep.sort_values("compression")
    ax.plot(sweep["compression"], sweep["ppl"], "o-", color=colour, ms=3, lw=1, label="val sweep")
    star = sweep[sweep["selected"].astype(bool)]
    ax.plot(star["compression"], star["ppl"], "*", color=colour, ms=13, label="tau* (val)")
    if len(test):
        test = test.sort_values("compression")
        ax.plot(test["compression"], test["ppl"], ":", color=colour, lw=1, label="test grid")
    if row is None:
        return
    y, lo, hi = row["test_ppl_tau_star"], row["test_ppl_tau_star_lo"], row["test_ppl_tau_star_hi"]
    yerr = [[y - lo], [hi - y]] if np.isfinite(lo) and np.isfinite(hi) else None
    ax.errorbar(row["test_compression"], y, yerr=yerr, fmt="o", mfc="none", mec=colour,
                ecolor=colour, ms=9, mew=1.5, label="gate at tau*, test")  # fmt: skip
    for key, marker, label in BASELINE_MARKERS:
        if f"{key}_test_ppl" in row and np.isfinite(row[f"{key}_test_ppl"]):
            ax.plot(row[f"{key}_compression"], row[f"{key}_test_ppl"], marker, color="0.3",
                    ms=7, label=label)  # fmt: skip
    if np.isfinite(row["backbone_test_ppl"]):
        ax.axhline(row["backbone_test_ppl"], color="0.5", ls="--", lw=1,
                   label=f"{row['backbone']} dense, test")  # fmt: skip


def ppl_vs_compression_figure(
    table5: pd.DataFrame, table2: pd.DataFrame, path: Path, sweep_test: pd.DataFrame | None = None
) -> Path:
    """Per gated cell, perplexity against compression (Figure 1). Validation and test share the
    axes but not the windows: the solid line is the validation sweep, the rest is test."""
    cells = list(dict.fromkeys(table5["cell"])) if len(table5) else []
    n = max(1, len(cells))
    cols = min(n, 2)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.0 * rows), squeeze=False)
    palette = sns.color_palette("tab10", n)
    on_test = table2[table2["text"] == "test"] if "text" in table2.columns else table2
    by_cell = {r["cell"]: r for _, r in on_test.iterrows()}
    empty = pd.DataFrame(columns=["cell", "compression", "ppl"])
    test = sweep_test if sweep_test is not None and len(sweep_test) else empty
    for ax, cell, colour in zip(axes.flat, cells, palette, strict=False):
        _panel(ax, table5[table5["cell"] == cell], test[test["cell"] == cell],
               by_cell.get(cell), colour)  # fmt: skip
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


def study_figures(tables: dict[str, pd.DataFrame], out_dir: Path) -> dict[str, Path]:
    """Every figure, drawn from the tables alone (so a merge of studies redraws them): Figure 1
    always; Figures 2-3 and the category bars where the diagnostics ran."""
    figures = {
        "fig1": ppl_vs_compression_figure(
            tables["table5"], tables["table2"], out_dir / FIG1, tables.get("sweep_test")
        )
    }
    if len(tables.get("support_removal", ())):
        figures["fig2"] = figure_perturbation(tables["support_removal"], out_dir / FIG2)
    if len(tables.get("rowsum_binarization", ())):
        figures["fig3"] = figure_rowsum_binarization(tables["rowsum_binarization"], out_dir / FIG3)
    if len(tables.get("table4_categories", ())):
        figures["fig4"] = figure_gate_categories(tables["table4_categories"], out_dir / FIG4)
    return figures


SHOWN = {
    "table2": ["text", "cell", "tau_star", "test_compression", "test_ppl_tau_star",
               "test_ppl_tau_star_lo", "test_ppl_tau_star_hi", "test_ppl_tau0",
               "backbone_test_ppl", "h2o_test_ppl", "keydiff_test_ppl", "h2o_even_test_ppl",
               "gate_keys_read_frac", "h2o_keys_read_frac"],
    "table5": ["cell", "tau", "ppl", "delta_ppl", "delta_log_ppl", "compression", "accepted",
               "selected"],
}  # fmt: skip
"""Columns study.md shows of its wide tables (the CSV and .md files keep every column)."""
SUMMARISED = {
    "table5": "the selected tau* of each cell; every grid point: table5.md",
    "sweep_test": "every grid point on test: sweep_test.md (drawn in Figure 1)",
    "support_removal": "per layer and window set: support_removal.md; the mean over layers: "
    "support_removal_summary below",
    "rowsum_binarization": "per layer: rowsum_binarization.md; the mean over layers: "
    "rowsum_binarization_summary below",
}


def _body(name: str, df: pd.DataFrame) -> str:
    """A table as study.md shows it: the chosen columns, long tables summarised."""
    if name == "decode_speed" and df.empty:
        return NOT_TIMED
    if name in SUMMARISED:
        if name == "table5" and "selected" in df.columns and len(df):
            df = df[df["selected"].astype(bool)]
        elif name != "table5":
            return f"Not shown here: {SUMMARISED[name]}."
        note = f"\n\nShown: {SUMMARISED[name]}."
    else:
        note = ""
    cols = [c for c in SHOWN.get(name, df.columns) if c in df.columns]
    return md_table(df[cols]) + note


def _fmt(iv_row: pd.Series) -> str:
    return f"{iv_row['diff']:+.3g} [{iv_row['lo']:+.3g}, {iv_row['hi']:+.3g}]"


def headline(tables: dict[str, pd.DataFrame]) -> str:
    """study.md's first lines: what ran and what held, per gated cell, with the intervals that
    decide it."""
    t1, t2, cmp = tables["table1"], tables["table2"], tables.get("comparisons")
    test1 = t1[t1["text"] == "test"] if "text" in t1.columns else t1
    ran = f"{HEADLINE_START} {len(test1)} cells ({', '.join(test1['cell'])}) scored on test"
    if "text" in t1.columns and (t1["text"] == "heldout").any():
        ran += " and a held-out text"
    if not len(t2):
        return ran + "; no gated cell, so nothing is evicted."
    test2 = t2[t2["text"] == "test"] if "text" in t2.columns else t2
    if (test2["test_compression"] == 0).all():
        return ran + (
            ". **Held:** nothing is evicted at this size: every gate stays above every grid "
            "point, so tau* = 0 and each baseline equals its dense backbone (a check of the "
            "plumbing, not of the paper's question)."
        )
    clauses = []
    for _, r in test2.iterrows():
        c = f"{r['cell']} evicts {r['test_compression']:.1%} at tau* {r['tau_star']:g}"
        if cmp is not None and len(cmp):
            mine = cmp[(cmp["text"] == "test") & (cmp["a"].str.startswith(r["cell"] + " "))]
            for kind in ("eviction cost", "tau0 gap", "gate vs h2o"):
                hit = mine[mine["comparison"] == kind]
                if len(hit):
                    h = hit.iloc[0]
                    c += f"; {kind} {_fmt(h)} PPL ({h['verdict']})"
        clauses.append(c)
    return (
        ran
        + ". **Held** (a - b with 95% intervals; `a better` = lower PPL): "
        + "; ".join(clauses)
        + "."
    )


def study_markdown(
    tables: dict[str, pd.DataFrame], figures: dict[str, Path], out_dir: Path, header: str = ""
) -> str:
    """study.md's text: a headline, the eviction tables, the diagnostics' tables (or a line
    saying they did not run; long ones summarised), then the figures."""
    lines = ["# KV-eviction study", "", headline(tables), ""]  # opens with HEADLINE_START
    if header:
        lines += [header, ""]
    for name in EVICTION_TABLES:
        lines += _section(name, CAPTIONS[name], _body(name, tables[name]))
    probes = [n for n in PROBE_TABLES if n in tables]
    if not probes:
        lines += ["## Diagnostics", "", "Not run with this report.", ""]
    for name in probes:
        lines += _section(name, CAPTIONS[name], _body(name, tables[name]))
    for name, path in figures.items():
        lines += [f"## {name}", "", f"![{name}]({os.path.relpath(path, out_dir)})", ""]
    return "\n".join(lines)


def write_study(
    tables: dict[str, pd.DataFrame], out_dir: Path, header: str = ""
) -> dict[str, Path]:
    """Every file of the study under ``out_dir`` (created): each table as CSV and markdown (the
    per-window records as ``windows.csv.gz`` only), the figures, study.md; returns ``{file
    name: path}``. ``tables``: ``StudyResult.tables()`` and, where the diagnostics ran,
    ``probe_tables``'s."""
    missing = [n for n in EVICTION_TABLES if n not in tables]
    if missing:
        raise ValueError(f"the study's tables {missing} are missing (have {sorted(tables)})")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, df in tables.items():
        if name == WINDOWS:
            paths[f"{WINDOWS}.csv.gz"] = out_dir / f"{WINDOWS}.csv.gz"
            df.to_csv(paths[f"{WINDOWS}.csv.gz"], index=False)
        else:
            paths.update(write_table(df, out_dir, name))
    figures = study_figures(tables, out_dir)
    paths.update({p.name: p for p in figures.values()})
    paths["study.md"] = out_dir / "study.md"
    paths["study.md"].write_text(study_markdown(tables, figures, out_dir, header))
    return paths


HEADLINE_START = "**Ran:**"


def _header_of(study_dir: Path) -> str:
    """The header paragraph of a study's study.md (its run, cells, windows and device)."""
    parts = [p.strip() for p in (study_dir / "study.md").read_text().split("\n\n")[1:]]
    parts = [p for p in parts if not p.startswith(HEADLINE_START)]
    return parts[0] if parts and not parts[0].startswith("#") else str(study_dir)


def _read_csv(path: Path) -> pd.DataFrame:
    """A table's CSV; an empty table (e.g. table2 of a study without a gated cell) has no header."""
    try:
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Rows of the non-empty parts (an all-NaN column, e.g. ``note``, keeps its dtype)."""
    full = [p for p in parts if len(p)] or parts[:1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # pandas' all-NA concat notice
        return pd.concat(full, ignore_index=True)


def read_study(study_dir: str | Path) -> dict[str, pd.DataFrame]:
    """The tables a study folder holds (its CSVs, the per-window records included), by name."""
    d = Path(study_dir)
    names = (*EVICTION_TABLES, *PROBE_TABLES)
    tables = {n: _read_csv(d / f"{n}.csv") for n in names if (d / f"{n}.csv").is_file()}
    if (d / f"{WINDOWS}.csv.gz").is_file():
        tables[WINDOWS] = _read_csv(d / f"{WINDOWS}.csv.gz")
    return tables


def study_header(study_dir: str | Path) -> str:
    """The header of a study's study.md: the text between its headline and first section."""
    text = (Path(study_dir) / "study.md").read_text()
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    parts = body.split("\n## ", 1)[0].strip().split("\n\n")
    return "\n\n".join(p for p in parts if not p.startswith(HEADLINE_START)).strip()


def merge_studies(study_dirs: list[str | Path], out_dir: str | Path) -> dict[str, Path]:
    """Studies of disjoint cells (e.g. one process per dense / gated pair) joined into one: each
    table's rows concatenated, the figures redrawn, study.md rewritten."""
    dirs = [Path(d) for d in study_dirs]
    read = [read_study(d) for d in dirs]
    tables: dict[str, pd.DataFrame] = {}
    for name in (*EVICTION_TABLES, *PROBE_TABLES, WINDOWS):
        parts = [r[name] for r in read if name in r]
        if parts:
            tables[name] = _concat(parts)
    if WINDOWS in tables:  # across processes: softmax and sigmoid sit in different pairs
        tables["comparisons"] = comparisons(tables[WINDOWS])
    t1 = tables.get("table1", pd.DataFrame(columns=["cell"]))
    cells = t1[t1["text"] == "test"]["cell"] if "text" in t1.columns else t1["cell"]
    if cells.duplicated().any():
        raise ValueError(f"cells {sorted(set(cells[cells.duplicated()]))} are in two studies")
    header = "\n".join([f"Merged from {', '.join(str(d) for d in dirs)}:", ""] + [
        f"- {_header_of(d)}" for d in dirs if (d / "study.md").is_file()
    ])  # fmt: skip
    return write_study(tables, Path(out_dir), header)


def replace_decode_speed(study_dir: str | Path, speed: pd.DataFrame, note: str = "") -> dict:
    """A written study with its decode_speed table replaced by ``speed``: every file rewritten
    from the folder's tables (figures redrawn), study.md's header kept with ``note`` added."""
    tables = read_study(study_dir)
    tables["decode_speed"] = speed
    header = "\n\n".join(h for h in (study_header(study_dir), note) if h)
    return write_study(tables, Path(study_dir), header)


# ---- the study of one run ---------------------------------------------------------------------


def probe_study_tables(cfg, cells: dict, run_dir: Path) -> dict[str, pd.DataFrame]:
    """The diagnostics on ``study.probe_windows`` test windows drawn across the split with
    ``study.seed`` (``probe_text.spread_indices``): support removal (both protocols), row-sum
    CVs and binarization per layer, gates per token category."""
    from stabilitylab.probes.model_probes import probe_tables
    from stabilitylab.probes.probe_text import cell_windows, gpt2_pieces_fn

    first = next(iter(cells.values()))
    tokens_BT, lengths_B, vocab = cell_windows(
        run_dir, list(cells), first.config.data, "test", cfg.study.probe_windows, cfg.study.seed
    )
    models = {name: c.model for name, c in cells.items()}
    return probe_tables(
        models, tokens_BT, lengths_B, gpt2_pieces_fn(vocab), cfg.study.probe_ps, cfg.study.seed,
        batch_size=cfg.study.batch_size,
    )  # fmt: skip


def study_report(cfg, device: str | None = None, *, grid=None, progress: bool = False):
    """Load ``cfg``'s trained cells (``<out_dir>/<name>/<cell>/``, the cells of ``cfg.cells``),
    run the eviction study and the diagnostics on ``device`` (CUDA when visible) and write
    ``study.out_dir`` (default ``<run dir>/study/``). ``grid``: the tau grid (default
    ``TAU_GRID``). Returns ``{file name: path}``."""
    import torch

    from stabilitylab import runs
    from stabilitylab.eviction.cells import load_cells
    from stabilitylab.eviction.protocol import TAU_GRID
    from stabilitylab.eviction.study import phase, run_study, study_inputs

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = Path(cfg.out_dir) / cfg.name
    cells = load_cells(run_dir, cfg.cells, device, expect=cfg)
    inputs = study_inputs(cfg, cells, grid=TAU_GRID if grid is None else grid, progress=progress)
    torch.manual_seed(cfg.study.seed)
    s = cfg.study
    tables = run_study(cells, inputs, timing=s.timing, repeats=s.timing_repeats).tables()
    with phase(f"diagnostics on {cfg.study.probe_windows} test windows"):
        tables.update(probe_study_tables(cfg, cells, run_dir))
    d = inputs.decode
    header = (
        f"Run `{run_dir}` (preset {cfg.preset}), cells {', '.join(cells)}; decode window: prefill "
        f"{d.prefill} + {d.window} scored tokens; {len(inputs.val.indices(d, inputs.val_windows))} "
        f"validation and {len(inputs.test.indices(d, inputs.test_windows))} test windows; "
        f"diagnostics on {cfg.study.probe_windows} test windows spread across the split (seed "
        f"{cfg.study.seed}; all if fewer); device {device}; tau grid "
        f"{list(inputs.grid)}; tau* rule {inputs.rule.describe()} on validation; baselines "
        f"{', '.join(inputs.baselines) or 'none'}"
        + (f" on {inputs.baseline_windows} test windows" if inputs.baseline_windows else "")
        + (f"; held-out text: {inputs.heldout_name}" if inputs.heldout is not None else "")
        + f"; intervals: paired bootstrap over windows, {inputs.n_boot} resamples."
    )
    return write_study(tables, runs.study_dir(cfg), header)


def check_test_windows(table1: pd.DataFrame, cells, inputs) -> None:
    """The windows about to be timed are the study's: each cell's test tokens in table1 equal
    ``inputs``' (same decode split and test windows), else a StudyError naming the cell."""
    from stabilitylab.eviction.cells import StudyError

    n = len(inputs.test.indices(inputs.decode, inputs.test_windows)) * inputs.decode.window
    if "text" in table1.columns:
        table1 = table1[table1["text"] == "test"]
    written = dict(zip(table1["cell"], table1["n_targets"], strict=True))
    for cell in cells:
        if written.get(cell) != n:
            raise StudyError(
                f"table1 scored {written.get(cell)} test tokens of {cell}, this config's "
                f"study.prefill / study.window / study.test_windows give {n}: another study"
            )


def time_study(cfg, study_dir=None, device: str | None = None, *, progress: bool = False):
    """Time the decode of a written study's gated cells in this process, alone on ``device``
    (CUDA when visible): the parallel study's parent, once every per-pair process has ended.
    tau* is the one table2 froze on validation (``recorded_selections`` applies the rule again
    to table5's sweep and checks the model's fingerprint); the test windows are ``cfg``'s,
    checked against table1's. Rewrites decode_speed and study.md (``replace_decode_speed``);
    returns ``{file name: path}``."""
    import torch

    from stabilitylab import runs
    from stabilitylab.eviction.cells import StudyError, load_cells
    from stabilitylab.eviction.speed import (
        DECODE_SPEED_COLUMNS,
        check_fingerprints,
        decode_speed,
        recorded_selections,
    )
    from stabilitylab.eviction.study import study_inputs

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    run_dir = Path(cfg.out_dir) / cfg.name
    study_dir = Path(study_dir or runs.study_dir(cfg))
    tables = read_study(study_dir)
    missing = [n for n in ("table1", "table2", "table5") if n not in tables]
    if missing:
        raise StudyError(f"{study_dir}: no {missing} to time; write the study first")
    gated = list(dict.fromkeys(tables["table2"].get("cell", ())))
    if not gated:
        return replace_decode_speed(study_dir, pd.DataFrame(columns=DECODE_SPEED_COLUMNS))
    cells = load_cells(run_dir, gated, device, expect=cfg)
    inputs = study_inputs(cfg, cells, progress=progress)
    check_test_windows(tables["table1"], gated, inputs)
    selections = recorded_selections(tables["table2"], tables["table5"], inputs.decode, str(study_dir))  # fmt: skip
    check_fingerprints(cells, selections, str(study_dir))
    repeats = cfg.study.timing_repeats
    speed = decode_speed(cells, selections, inputs, repeats=repeats, alone=True)
    note = (
        f"decode_speed: timed after the study's tables were written, by one process alone on "
        f"{device} ({repeats} alternating dense / tau* runs per gated cell), at table2's tau*."
    )
    return replace_decode_speed(study_dir, speed, note)


def main(argv: list[str] | None = None) -> int:
    """``python analysis/kv_study.py --merge DIR [DIR ...] --out DIR``: join studies of
    disjoint cells (the study itself runs from experiments/kv_study.py)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--merge", nargs="+", required=True, help="study directories to join")
    p.add_argument("--out", required=True, help="the joined study's directory")
    args = p.parse_args(argv)
    try:
        paths = merge_studies(args.merge, args.out)
    except (FileNotFoundError, ValueError, KeyError) as e:
        p.error(f"{type(e).__name__}: {e}")
    print(f"study: {paths['study.md']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
