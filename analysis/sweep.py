"""Learning-rate sweep: final loss vs effective LR per arm variant and seed, and LR sensitivity.

    python analysis/sweep.py runs/            # every arm dir under runs/ -> runs/sweep/
    python analysis/sweep.py runs/lr*         # -> runs/sweep/ (beside the first run)
    python analysis/sweep.py runs/lr* --out /tmp/sweep

Groups: arm, plus ``+qk-ln`` when config.json has model.qk_layernorm, and the seed. Effective
lr = train.lr * train.lr_scale. LR sensitivity (Wortsman et al. 2023, "Small-scale proxies for
large-scale Transformer training instabilities"), per group over its swept LRs:

    S = mean_lr [ min(L_final(lr), L_init) - min_lr' min(L_final(lr'), L_init) ]

with a diverged run counted at its initial loss (L_init = mean of the first 5 logged losses,
L_final = mean of the last 5). Runs repeated at one LR in a group are averaged first. S is NaN
for a group where every run diverged (nothing to compare against). Writes sweep.md, sweep.csv
(one row per run, with its group's S) and sweep.png (log-x; diverged runs marked x).

A sweep finished in several sittings: ``--include earlier/sweep.csv`` adds that table's runs;
where a new run has the same (variant, seed, lr), the new one replaces the earlier row.

    python analysis/sweep.py runs/lrsweep2__* --include results/lr_sweep/sweep.csv --out /tmp/s
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from stabilitylab import tags  # noqa: E402
from stabilitylab.analysis import markdown  # noqa: E402
from stabilitylab.analysis.cli import run_writer  # noqa: E402
from stabilitylab.analysis.early_warning import divergence_of  # noqa: E402
from stabilitylab.analysis.events import (  # noqa: E402
    discover,
    load_config,
    load_found,
    load_summary,
    select,
    series,
)
from stabilitylab.analysis.stats import final_mean, initial_mean  # noqa: E402

RUN_COLUMNS = [
    "run", "arm", "variant", "seed", "lr", "initial_loss", "final_loss", "diverged",
    "divergence_step", "clipped_loss", "status", "steps", "max_grad_norm", "max_logit",
]  # fmt: skip
OPTIONAL_COLUMNS = ("max_grad_norm", "max_logit")
"""From summary.json (every-step maxima); an older sweep.csv without them merges with NaN."""
GROUP_COLUMNS = [
    "variant", "seed", "n_lrs", "n_diverged", "n_incomplete", "best_lr", "best_loss", "lr_sensitivity",
]  # fmt: skip
COMPLETE = ("stable", "diverged")
"""Statuses of a finished run; an interrupted or unfinished run's final loss is from fewer steps."""


def variant_of(config: dict, arm: str) -> str:
    qk_ln = bool(config.get("model", {}).get("qk_layernorm", False))
    return f"{arm}+qk-ln" if qk_ln else arm


def effective_lr(config: dict, where: Path) -> float:
    train = config.get("train", {})
    if "lr" not in train:
        raise ValueError(
            f"{where / 'config.json'} has no train.lr; cannot place the run on the sweep"
        )
    return float(train["lr"]) * float(train.get("lr_scale", 1.0))


def sweep_table(run_dirs: list[str | Path]) -> pd.DataFrame:
    """One row per arm dir (columns ``RUN_COLUMNS``).

    ``diverged`` = summary.json says so, or ``detectors.diverged`` fires on the event data, or
    the final loss is not finite. ``clipped_loss`` = the loss the score uses: the initial loss
    for a diverged run, else ``min(final, initial)``.
    """
    found = discover(run_dirs)
    df = load_found(found)
    rows = []
    for arm_dir, run, arm in found:
        config = load_config(arm_dir)
        if config is None:
            raise ValueError(f"no config.json in {arm_dir}; a sweep needs each run's lr and seed")
        d = select(df, run, arm)
        _, loss = series(d, tags.LOSS)
        if loss.size == 0:
            raise ValueError(f"no {tags.LOSS} scalars in {arm_dir}")
        summary = load_summary(arm_dir) or {}
        found_div = divergence_of(d)
        init, final = initial_mean(loss), final_mean(loss)
        diverged = (
            summary.get("status") == "diverged" or found_div is not None or not math.isfinite(final)
        )
        div_step = summary.get("divergence_step")
        if div_step is None and found_div is not None:
            div_step = found_div.step
        rows.append(
            {
                "run": run,
                "arm": arm,
                "variant": variant_of(config, arm),
                "seed": config.get("train", {}).get("seed"),
                "lr": effective_lr(config, arm_dir),
                "initial_loss": init,
                "final_loss": final,
                "diverged": diverged,
                "divergence_step": div_step,
                "clipped_loss": init if diverged else min(final, init),
                "status": "diverged" if diverged else summary.get("status", "unfinished"),
                "steps": summary.get("steps"),
                "max_grad_norm": summary.get("max_grad_norm"),
                "max_logit": summary.get("max_logit"),
            }
        )
    out = pd.DataFrame(rows, columns=RUN_COLUMNS).astype(
        {"divergence_step": "Int64", "steps": "Int64", "max_grad_norm": float, "max_logit": float}
    )
    return out.sort_values(["variant", "seed", "lr"], kind="stable").reset_index(drop=True)


def lr_sensitivity(table: pd.DataFrame) -> pd.DataFrame:
    """Per (variant, seed) group: LR sensitivity and best LR (columns ``GROUP_COLUMNS``).

    ``table`` needs columns variant, seed, lr, diverged, clipped_loss (``sweep_table``'s).
    """
    missing = {"variant", "seed", "lr", "diverged", "clipped_loss"} - set(table.columns)
    if missing:
        raise ValueError(f"sweep table lacks columns {sorted(missing)}")
    if table.empty:
        raise ValueError("sweep table is empty")
    rows = []
    for (variant, seed), g in table.groupby(["variant", "seed"], sort=True, dropna=False):
        per_lr = g.groupby("lr")["clipped_loss"].mean()
        all_diverged = bool(g["diverged"].all())
        best = float(per_lr.min())
        score = math.nan if all_diverged else float((per_lr - best).mean())
        rows.append(
            {
                "variant": variant,
                "seed": seed,
                "n_lrs": int(per_lr.size),
                "n_diverged": int(g["diverged"].sum()),
                "n_incomplete": int((~g["status"].isin(COMPLETE)).sum()) if "status" in g else 0,
                "best_lr": math.nan if all_diverged else float(per_lr.idxmin()),
                "best_loss": math.nan if all_diverged else best,
                "lr_sensitivity": score,
            }
        )
    return pd.DataFrame(rows, columns=GROUP_COLUMNS)


def sweep_figure(table: pd.DataFrame, groups: pd.DataFrame, path: str | Path) -> None:
    """Clipped final loss vs effective LR (log x), one line per group, diverged runs as x."""
    variants = sorted(table["variant"].unique())
    palette = dict(zip(variants, sns.color_palette("tab10", len(variants)), strict=True))
    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    score = {(r.variant, r.seed): r.lr_sensitivity for r in groups.itertuples(index=False)}
    for (variant, seed), g in table.groupby(["variant", "seed"], sort=True, dropna=False):
        per_lr = g.groupby("lr")["clipped_loss"].mean()
        s = score.get((variant, seed), math.nan)
        ax.plot(
            per_lr.index, per_lr.to_numpy(), marker="o", color=palette[variant],
            label=f"{variant} seed {seed} (S={markdown.fmt(s)})",
        )  # fmt: skip
        bad = g[g["diverged"]]
        ax.scatter(bad["lr"], bad["clipped_loss"], marker="x", s=90, color="black", zorder=3)
    ax.scatter([], [], marker="x", color="black", label="diverged (at initial loss)")
    ax.set_xscale("log")
    ax.set_xlabel("effective learning rate (lr x lr_scale)")
    ax.set_ylabel("final loss, clipped at initial")
    ax.set_title("LR sweep")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_tables(new: pd.DataFrame, earlier: list[pd.DataFrame]) -> pd.DataFrame:
    """``new`` plus the rows of ``earlier`` tables whose (variant, seed, lr) ``new`` lacks."""
    key = ["variant", "seed", "lr"]
    parts = [new]
    seen = set(map(tuple, new[key].itertuples(index=False)))
    for i, old in enumerate(earlier):
        missing = set(RUN_COLUMNS) - set(old.columns) - set(OPTIONAL_COLUMNS)
        if missing:
            raise ValueError(f"included sweep table {i} lacks columns {sorted(missing)}")
        old = old.reindex(columns=RUN_COLUMNS)
        keep = [tuple(k) not in seen for k in old[key].itertuples(index=False)]
        parts.append(old[keep])
        seen |= set(map(tuple, old[key].itertuples(index=False)))
    out = pd.concat(parts, ignore_index=True).astype({"divergence_step": "Int64", "steps": "Int64"})
    return out.sort_values(["variant", "seed", "lr"], kind="stable").reset_index(drop=True)


def default_out_dir(run_dirs: list[str | Path]) -> Path:
    """``<folder that holds the first run>/sweep``: beside the runs, whatever their common
    parent (runs from two trees would otherwise put it in the working directory)."""
    arm_dir, _run, arm = discover(run_dirs)[0]
    run_dir = arm_dir.parent if arm_dir.name == arm else arm_dir
    return run_dir.parent / "sweep"


def write_sweep(
    run_dirs: list[str | Path],
    out_dir: str | Path | None = None,
    include: list[str | Path] = (),
) -> dict[str, Path]:
    """Write sweep.md, sweep.csv, sweep.png; returns ``{file name: path}``.

    ``out_dir`` defaults to ``default_out_dir(run_dirs)``; ``include``: earlier sweep.csv files
    merged in (``merge_tables``).
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ValueError("no run directories given")
    earlier = []
    for path in include:
        if not Path(path).is_file():
            raise FileNotFoundError(f"included sweep table not found: {path}")
        earlier.append(pd.read_csv(path))
    table = merge_tables(sweep_table(run_dirs), earlier)
    groups = lr_sensitivity(table)
    out = Path(out_dir) if out_dir is not None else default_out_dir(run_dirs)
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("sweep.md", "sweep.csv", "sweep.png")}
    score = groups.set_index(["variant", "seed"])["lr_sensitivity"]
    table.assign(
        lr_sensitivity=[
            score.get((v, s), math.nan)
            for v, s in zip(table["variant"], table["seed"], strict=True)
        ]
    ).to_csv(paths["sweep.csv"], index=False)
    sweep_figure(table, groups, paths["sweep.png"])
    lines = [
        "# LR sweep",
        "",
        "LR sensitivity S = mean over LRs of (min(final, initial) - best of group); diverged runs "
        "count at their initial loss (Wortsman et al. 2023). Lower is more robust. "
        "`n_incomplete` counts runs that stopped early (interrupted/unfinished): their final "
        "loss is from fewer steps, so compare those groups with care.",
        "",
        markdown.table(groups),
        "",
        "## Runs",
        "",
        markdown.table(table),
        "",
        "![sweep](sweep.png)",
        "",
    ]
    paths["sweep.md"].write_text("\n".join(lines))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs or a folder of them"
    )
    parser.add_argument(
        "--out", default=None, help="output folder (default: sweep/ beside the first run)"
    )
    parser.add_argument(
        "--include", action="append", default=[], metavar="CSV", help="an earlier sweep.csv"
    )
    args = parser.parse_args(argv)
    return run_writer(lambda: write_sweep(args.run_dirs, args.out, args.include), "sweep.md")


if __name__ == "__main__":
    sys.exit(main())
