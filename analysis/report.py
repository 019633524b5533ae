"""Report over one or more runs: per-arm table, early-warning table, figures, tidy CSVs.

    python analysis/report.py runs/smoke            # paired run -> runs/smoke/report/
    python analysis/report.py runs/a/softmax runs/b --out /tmp/report

Writes report.md, summary.csv (one row per arm), early_warning.csv, scalars.csv (every scalar,
tidy: run, arm, step, tag, value), figure.png (loss / grad norm / layer-0 max logit, divergence
marked) and heatmap.png (per-layer max logit over steps, one panel per arm). A missing tag
leaves a panel empty with a note in the figure and in report.md. Bad paths print one line and
exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from stabilitylab.analysis import markdown, plots
from stabilitylab.analysis.cli import run_writer
from stabilitylab.analysis.events import discover, load_found, load_summary
from stabilitylab.analysis.stats import SUMMARY_COLUMNS, arm_row

REPORT_FILES = (
    "report.md", "summary.csv", "early_warning.csv", "scalars.csv", "figure.png", "heatmap.png",
)  # fmt: skip
WARNING_COLUMNS = ["run", "arm", "precursor", "tag", "step", "divergence_step", "lead_steps"]


def build_tables(
    df: pd.DataFrame, summaries: dict[tuple[str, str], dict | None]
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary table, early-warning table)`` for every arm in the tidy frame ``df``."""
    rows, tables = [], []
    for (run, arm), df_arm in df.groupby(["run", "arm"], sort=False):
        if df_arm.empty:
            continue
        row, warn = arm_row(df_arm, summaries.get((run, arm)))
        rows.append(row)
        tables.append(warn)
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    summary = summary.astype(
        {"divergence_step": "Int64", "detected_step": "Int64", "lead_steps": "Int64"}
    )
    # Rows, not pd.concat: a precursor column that is all-missing in one arm is not dropped.
    early = pd.DataFrame(
        [r for t in tables for r in t.to_dict("records")],
        columns=tables[0].columns if tables else None,
    )
    early = early.astype({"step": "Int64", "divergence_step": "Int64", "lead_steps": "Int64"})
    return summary, early


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the report files for ``run_dirs`` and return their paths.

    Keys are the file names in ``REPORT_FILES`` (``"report.md"``, ``"summary.csv"``,
    ``"early_warning.csv"``, ``"scalars.csv"``, ``"figure.png"``, ``"heatmap.png"``).
    ``out_dir`` defaults to ``<first run dir>/report``. Raises
    FileNotFoundError / ValueError naming the path when a run dir is missing or has no events.
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ValueError("no run directories given")
    found = discover(run_dirs)
    df = load_found(found)
    if df.empty:
        raise ValueError(f"no scalars in the event files under {', '.join(map(str, run_dirs))}")
    summaries = {(run, arm): load_summary(d) for d, run, arm in found}

    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in REPORT_FILES}
    summary, early = build_tables(df, summaries)
    divergence = {
        (r.run, r.arm): (None if pd.isna(r.divergence_step) else int(r.divergence_step))
        for r in summary.itertuples(index=False)
    }
    notes = plots.curves_figure(df, divergence, paths["figure.png"])
    notes += plots.logit_heatmap(df, paths["heatmap.png"])

    df.to_csv(paths["scalars.csv"], index=False)
    summary.to_csv(paths["summary.csv"], index=False)
    early.to_csv(paths["early_warning.csv"], index=False)
    paths["report.md"].write_text(_markdown(summary, early, notes, found))
    return paths


def _markdown(summary, early, notes, found) -> str:
    lines = ["# Stability report", "", "Runs:"]
    lines += [f"- `{d}` (run `{run}`, arm `{arm}`)" for d, run, arm in found]
    lines += [
        "",
        "## Per arm",
        "",
        "Max and growth (= max / median of the first 10 logged points) are over the logged "
        "points, so they can sit below summary.json's every-step maxima. Status and divergence "
        "step from summary.json when present; detected_step = `detectors.diverged` on the "
        "logged loss and grad norm.",
        "",
        markdown.table(summary),
        "",
        "## Early warning",
        "",
        "Step at which each precursor detector first fired; lead = divergence step - that step "
        "(negative: after the divergence; `-`: never fired, or no divergence). On a stable arm "
        "any firing is a false alarm.",
        "",
    ]
    if early.empty:
        lines.append("No precursor had data.")
    else:
        lines.append(markdown.table(early[WARNING_COLUMNS]))
    lines += ["", "## Figures", "", "![curves](figure.png)", "", "![max logit](heatmap.png)", ""]
    if notes:
        lines += ["Notes:", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="arm dir or paired run dir")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    return run_writer(lambda: write_report(args.run_dirs, args.out), "report.md")


if __name__ == "__main__":
    sys.exit(main())
