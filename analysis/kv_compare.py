"""Several KV-eviction studies side by side: the spread across seeds, and ablations beside a run.

    python analysis/kv_compare.py runs/kv_reduced/study runs/kv_reduced_seed1/study \\
        --out runs/kv_compare/seeds                       # mean, std, min, max per cell
    python analysis/kv_compare.py runs/kv_reduced/study runs/inj_logits/study --no-spread \
        --out runs/kv_compare/injection                   # ablations: the runs side by side

Each argument is a study directory (``experiments/kv_study.py`` writes ``runs/<name>/study/``)
holding ``table1.csv`` and ``table2.csv``. Their rows are concatenated with a ``run`` column (the
run name, the study directory's parent), then every numeric column is summarised per cell over
the runs: ``mean``, ``std`` (sample, ddof 1; NaN with one run), ``min``, ``max`` and ``n``. Writes
``<table>_runs.csv`` (all rows), ``<table>_spread.csv`` and ``compare.md`` (every run's main
columns side by side, e.g. ablations of one cell; then mean ± std for cells with several runs,
e.g. seeds) under ``--out``. Tables with a ``text`` column (test, heldout) are grouped per text
and cell.

Seeds decide a comparison by an interval: where every study holds ``comparisons.csv`` (each
PPL difference with its paired bootstrap interval over windows), ``comparisons_seeds.csv`` and
the last section of compare.md give per comparison the mean difference over the runs with its
Student-t 95% interval, and how many runs' own intervals decided each way
(``analysis.kv_intervals.seed_comparisons``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from stabilitylab.analysis.kv_intervals import seed_comparisons
from stabilitylab.analysis.markdown import table as markdown_table

TABLES = ("table1", "table2")
KEY = "cell"
SHOWN = {
    "table1": ["test_ppl", "train_val_ppl"],
    "table2": ["tau_star", "test_compression", "test_ppl_tau0", "test_ppl_tau_star",
               "backbone_test_ppl", "h2o_test_ppl", "keydiff_test_ppl", "h2o_even_test_ppl",
               "gate_keys_read_frac"],
}  # fmt: skip
"""The columns ``compare.md`` shows per run (the CSVs keep every column)."""


def run_name(study_dir: Path) -> str:
    """``runs/kv_reduced_seed1/study`` -> ``kv_reduced_seed1``."""
    return study_dir.resolve().parent.name


def run_labels(study_dirs: Sequence[str | Path], labels: Sequence[str] | None) -> list[str]:
    """One label per study: ``labels`` as given (one per directory), else each run's name."""
    if labels is None:
        return [run_name(Path(d)) for d in study_dirs]
    if len(labels) != len(study_dirs):
        raise ValueError(f"{len(labels)} labels for {len(study_dirs)} study directories")
    return list(labels)


def read_tables(
    study_dirs: Sequence[str | Path], name: str, labels: Sequence[str] | None = None
) -> pd.DataFrame:
    """Table ``name`` of every study, concatenated, with the run each row came from (its label:
    ``labels`` in the order of ``study_dirs``, else the run's name)."""
    frames = []
    for d, label in zip(map(Path, study_dirs), run_labels(study_dirs, labels), strict=True):
        path = d / f"{name}.csv"
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: is {d} a study directory?")
        frames.append(pd.read_csv(path).assign(run=label))
    runs = [f["run"].iloc[0] for f in frames if len(f)]
    if len(set(runs)) != len(runs):
        raise ValueError(f"two study directories come from the same run: {sorted(runs)}")
    return pd.concat(frames, ignore_index=True)


def _keys(df: pd.DataFrame, key: str) -> list[str]:
    return ["text", key] if "text" in df.columns else [key]


def spread(df: pd.DataFrame, key: str = KEY) -> pd.DataFrame:
    """Per ``key`` value (and text, where the tables have one), each numeric column's mean, std
    (ddof 1), min, max over the rows, and the number of runs; one column per (statistic,
    quantity), named ``<quantity>_<stat>``."""
    if key not in df.columns:
        raise ValueError(f"no {key!r} column to group by (columns: {list(df.columns)})")
    keys = _keys(df, key)
    numeric = [c for c in df.select_dtypes("number").columns if c not in keys]
    grouped = df.groupby(keys, sort=False)
    out = grouped[numeric].agg(["mean", "std", "min", "max"])
    out.columns = [f"{q}_{stat}" for q, stat in out.columns]
    out.insert(0, "n_runs", grouped["run"].nunique())
    return out.reset_index()


def mean_pm_std(sp: pd.DataFrame, quantities: Sequence[str], key: str = KEY) -> pd.DataFrame:
    """A compact view for markdown: ``mean ± std`` per quantity (``mean`` alone with one run)."""
    rows = []
    for r in sp.itertuples(index=False):
        row = {k: getattr(r, k) for k in _keys(sp, key)} | {"runs": r.n_runs}
        for q in quantities:
            m, s = getattr(r, f"{q}_mean"), getattr(r, f"{q}_std")
            row[q] = f"{m:.4g}" if pd.isna(s) else f"{m:.4g} ± {s:.2g}"
        rows.append(row)
    return pd.DataFrame(rows)


def write_compare(
    study_dirs: Sequence[str | Path],
    out: str | Path,
    spread_md: bool = True,
    labels: Sequence[str] | None = None,
) -> Path:
    """``spread_md=False`` for runs that differ in a setting (ablations): no mean over them."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# KV-eviction studies compared: {', '.join(map(str, study_dirs))}", ""]
    for name in TABLES:
        df = read_tables(study_dirs, name, labels)
        sp = spread(df)
        df.to_csv(out / f"{name}_runs.csv", index=False)
        sp.to_csv(out / f"{name}_spread.csv", index=False)
        shown = [c for c in SHOWN[name] if c in df.columns]
        parts += [
            f"## {name}: every run",
            "",
            markdown_table(df[[*_keys(df, KEY), "run", *shown]]),
            "",
        ]
        repeated = sp[sp["n_runs"] > 1]
        if spread_md and len(repeated):
            view = mean_pm_std(repeated, shown)
            parts += [
                f"## {name}: mean ± std over the runs of a cell",
                "",
                markdown_table(view),
                "",
            ]
    parts += _seed_comparisons(study_dirs, out, labels, spread_md)
    path = out / "compare.md"
    path.write_text("\n".join(parts))
    return path


def _seed_comparisons(study_dirs, out: Path, labels, spread_md: bool) -> list[str]:
    """compare.md's section on the comparisons over runs (where every study has them)."""
    if not all((Path(d) / "comparisons.csv").is_file() for d in study_dirs):
        return []
    per_run = read_tables(study_dirs, "comparisons", labels)
    per_run.to_csv(out / "comparisons_runs.csv", index=False)
    if not spread_md or per_run.empty:
        return []
    seeds = seed_comparisons(per_run)
    seeds.to_csv(out / "comparisons_seeds.csv", index=False)
    caption = (
        "Each comparison's difference a - b (PPL) per run, their mean with the Student-t 95% "
        "interval over runs, and how many runs' own bootstrap intervals found a or b better; "
        "`verdict` is the mean interval's (undecided where it spans 0)."
    )
    return ["## comparisons over the runs", "", caption, "", markdown_table(seeds), ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("study_dirs", nargs="+", help="study directories (runs/<name>/study)")
    p.add_argument("--out", required=True, help="where compare.md and the CSVs go")
    p.add_argument(
        "--spread", action=argparse.BooleanOptionalAction, default=True,
        help="mean ± std per cell in compare.md (--no-spread for ablations: runs that differ)",
    )  # fmt: skip
    p.add_argument(
        "--labels", nargs="+", default=None,
        help="one name per study directory for the run column (default: each run's name)",
    )  # fmt: skip
    args = p.parse_args(argv)
    try:
        path = write_compare(args.study_dirs, args.out, args.spread, args.labels)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
