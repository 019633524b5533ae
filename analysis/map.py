"""Stability map: which settings break which arm, over any set of runs.

    python analysis/map.py runs/hunt_* runs/wide_* --out results/map     # -> map.md, map.csv, map.png

A *setting* is what the runs' resolved configs (config.json) differ in, found automatically:
every config key whose value is not the same in all runs, except the arm, the seed and
bookkeeping (names, paths, cadences of telemetry and checkpoints). Seeds of one setting are
pooled. Each arm dir gets one outcome:

    diverged      summary.json says so (the issue's rule: grad norm >= 10^3 x its earlier median
                  with the loss back at its start, or a non-finite loss/gradient)
    loss blow-up  not diverged, but ``detectors.loss_blowup`` fires on the logged loss
                  (>= 2x its first value for 5 logged points after it had come down, or for
                  50 in a row from the start)
    stable        finished without either
    unfinished    no summary.json, or stopped early without a divergence (interrupted)

map.csv: one row per arm dir (setting keys, seed, arm, outcome, steps, maxima). map.md: per
setting and arm, the counts ``diverged / blow-up / n`` and the steps at which they happened.
map.png: the fraction of failed runs (diverged or blow-up) per setting and arm.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from stabilitylab import tags  # noqa: E402
from stabilitylab.analysis import detectors as det  # noqa: E402
from stabilitylab.analysis import markdown  # noqa: E402
from stabilitylab.analysis.cli import run_writer  # noqa: E402
from stabilitylab.analysis.events import (  # noqa: E402
    discover,
    load_arm,
    load_config,
    load_summary,
    series,
)
from stabilitylab.analysis.settings import (  # noqa: E402
    flatten,
    varying_keys,
    with_setting_ids,
)

OUTCOMES = ("diverged", "loss blow-up", "stable", "unfinished")


def outcome_of(
    summary: dict | None, loss_steps: np.ndarray, loss: np.ndarray
) -> tuple[str, int | None]:
    """``(outcome, step)`` of one arm; see the module docstring."""
    if summary is not None and summary.get("status") == "diverged":
        return "diverged", summary.get("divergence_step")
    blowup = det.loss_blowup(loss_steps, loss) if loss.size else None
    if blowup is not None:
        return "loss blow-up", blowup.step
    if summary is None or summary.get("status") != "stable":
        return "unfinished", None
    return "stable", None


def run_table(paths: list[str | Path]) -> tuple[pd.DataFrame, list[str]]:
    """One row per arm dir under ``paths``, and the setting keys."""
    found = discover(paths)
    configs = []
    for arm_dir, _run, _arm in found:
        config = load_config(arm_dir)
        if config is None:
            raise ValueError(f"no config.json in {arm_dir}; a map needs each run's settings")
        configs.append(config)
    keys = varying_keys(configs)
    rows = []
    for (arm_dir, run, arm), config in zip(found, configs, strict=True):
        df, _ = load_arm(arm_dir, run, arm)
        loss_steps, loss = series(df, tags.LOSS)
        summary = load_summary(arm_dir)
        outcome, step = outcome_of(summary, loss_steps, loss)
        flat = flatten(config)
        summary = summary or {}
        rows.append(
            {
                **{k: flat.get(k) for k in keys},
                "seed": flat.get("train.seed"),
                "arm": arm,
                "run": run,
                "outcome": outcome,
                "outcome_step": step,
                "steps": summary.get("steps"),
                "max_grad_norm": summary.get("max_grad_norm"),
                "max_logit": summary.get("max_logit"),
            }
        )
    table = pd.DataFrame(rows).astype({"outcome_step": "Int64", "steps": "Int64"})
    return table.sort_values([*keys, "arm", "seed"], kind="stable").reset_index(drop=True), keys


def map_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per (setting, arm): n, seeds, diverged, blow-ups, failed fraction, steps of the failures."""
    rows = []
    for (setting, arm), g in runs.groupby(["setting", "arm"], sort=False):
        counts = g["outcome"].value_counts()
        failed = g[g["outcome"].isin(("diverged", "loss blow-up"))]
        rows.append(
            {
                "setting": setting,
                "arm": arm,
                "n": len(g),
                "seeds": ",".join(str(s) for s in sorted(g["seed"].dropna().unique())),
                "diverged": int(counts.get("diverged", 0)),
                "loss_blowup": int(counts.get("loss blow-up", 0)),
                "unfinished": int(counts.get("unfinished", 0)),
                "failed_fraction": len(failed) / len(g),
                "failure_steps": ",".join(str(s) for s in failed["outcome_step"].dropna()),
            }
        )
    return pd.DataFrame(rows)


def cells(summary: pd.DataFrame) -> pd.DataFrame:
    """Settings x arms, each cell ``diverged/blow-up/n`` plus the failure steps."""
    text = [
        f"{r.diverged}/{r.loss_blowup}/{r.n}"
        + (f" at {r.failure_steps}" if r.failure_steps else "")
        for r in summary.itertuples(index=False)
    ]
    wide = summary.assign(cell=text).pivot(index="setting", columns="arm", values="cell")
    order = sorted(wide.index, key=lambda s: int(s[1:]))
    return wide.loc[order].reset_index().rename_axis(columns=None)


def map_figure(summary: pd.DataFrame, path: str | Path) -> None:
    """Heatmap of the failed fraction, settings x arms, cells annotated ``d/b/n``."""
    frac = summary.pivot(index="setting", columns="arm", values="failed_fraction")
    frac = frac.loc[sorted(frac.index, key=lambda s: int(s[1:]))]
    note = (
        summary.assign(
            cell=[f"{r.diverged}/{r.loss_blowup}/{r.n}" for r in summary.itertuples(index=False)]
        )
        .pivot(index="setting", columns="arm", values="cell")
        .loc[frac.index]
    )
    fig, ax = plt.subplots(figsize=(2.5 + 1.4 * frac.shape[1], 1.2 + 0.35 * frac.shape[0]))
    im = ax.imshow(frac.to_numpy(dtype=float), cmap="Reds", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(frac.shape[1]), frac.columns)
    ax.set_yticks(range(frac.shape[0]), frac.index, fontsize=8)
    for i in range(frac.shape[0]):
        for j in range(frac.shape[1]):
            text = note.iat[i, j]
            dark = frac.iat[i, j] > 0.6
            ax.text(j, i, "" if pd.isna(text) else text, ha="center", va="center", fontsize=8,
                    color="white" if dark else "black")  # fmt: skip
    ax.set_title("failed fraction\n(cells: diverged / loss blow-up / runs)", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_map(paths: list[str | Path], out_dir: str | Path) -> dict[str, Path]:
    runs, keys = run_table(paths)
    runs, settings = with_setting_ids(runs, keys)
    summary = map_table(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths_out = {name: out / name for name in ("map.md", "map.csv", "map.png")}
    runs.to_csv(paths_out["map.csv"], index=False)
    map_figure(summary, paths_out["map.png"])
    lines = [
        "# Stability map",
        "",
        "Outcomes: diverged (the run-level rule, summary.json), loss blow-up "
        "(`detectors.loss_blowup` on the logged loss, when not diverged), stable, unfinished. "
        "Cells: diverged / loss blow-up / runs, then the steps of the failures.",
        "",
        markdown.table(cells(summary)),
        "",
        "## Settings (the config keys the runs differ in)",
        "",
        markdown.table(settings),
        "",
        "![map](map.png)",
        "",
    ]
    paths_out["map.md"].write_text("\n".join(lines))
    return paths_out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs or folders of them"
    )
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    return run_writer(lambda: write_map(args.run_dirs, args.out), "map.md")


if __name__ == "__main__":
    sys.exit(main())
