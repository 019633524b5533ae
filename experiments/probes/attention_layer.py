"""Jacobian of a whole toy attention layer, x -> P(x W_Q (x W_K)^T / sqrt(d)) x W_V, w.r.t. x.

    python experiments/probes/attention_layer.py      # ~30 s on a laptop CPU; writes runs/probes/attention_layer.{csv,png}

Exact spectral norms (autograd, float64) for softmax and sigmoid (b = -log n), QK-LayerNorm off
and on, (a) as the input scale grows at n = 16, so scores grow like scale^2, and (b) as n grows at
scale 1. Prints the medians over random draws and log-log slopes per range. Measured, not assumed:
without QK-LN both kinds grow with the input scale at first; sigmoid's keeps growing (its value
path is not normalised), softmax's falls once attention saturates; QK-LN holds both flat.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from stabilitylab.probes.sweeps import layer_table, median_curve, slope_table


def parse_ranges(text: str) -> list[tuple[float, float]]:
    """``"0.1:1,1:10"`` -> ``[(0.1, 1.0), (1.0, 10.0)]``."""
    try:
        ranges = [tuple(float(v) for v in part.split(":")) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"ranges must look like 0.1:1,1:10, got {text!r}") from None
    if any(len(r) != 2 or not 0 < r[0] < r[1] for r in ranges):
        raise ValueError(f"each range needs 0 < lo < hi, got {text!r}")
    return ranges


def plot(
    scale_curve: pd.DataFrame, n_curve: pd.DataFrame, n: int, scale: float, path: Path
) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, curve, x, title in (
        (axes[0], scale_curve, "scale", f"vs input scale (n={n})"),
        (axes[1], scale_curve, "max_abs_score", f"vs max |score| (n={n})"),
        (axes[2], n_curve, "n", f"vs sequence length (scale={scale})"),
    ):
        for (kind, qk_ln), g in curve.groupby(["kind", "qk_ln"]):
            color = "C0" if kind == "softmax" else "C3"
            ls = "--" if qk_ln else "-"
            label = f"{kind}, QK-LN {'on' if qk_ln else 'off'}"
            ax.plot(g[x], g.sigma, ls, color=color, marker="o", ms=3, label=label)
            ax.fill_between(g[x], g.sigma_min, g.sigma_max, color=color, alpha=0.12)
        ax.set(xscale="log", yscale="log", xlabel=x, ylabel="||dy/dx||_2 (exact)", title=title)
    axes[2].set_xticks(sorted(n_curve.n.unique()), [str(v) for v in sorted(n_curve.n.unique())])
    axes[2].xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    axes[0].legend(fontsize=8)
    fig.suptitle("Toy attention layer Jacobian spectral norm (median, band: min-max over draws)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    sns.set_theme(style="whitegrid")
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=16, help="tokens for the scale sweep")
    p.add_argument("--scales", type=float, nargs="+", default=list(np.logspace(-1, 1.5, 11)))
    p.add_argument("--ns", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--scale", type=float, default=1.0, help="input scale for the length sweep")
    p.add_argument("--dim", type=int, default=16, help="model width C = head width D")
    p.add_argument("--draws", type=int, default=8, help="random (x, W) draws per point")
    p.add_argument("--scale-ranges", default="0.1:1,1:10,10:31.7")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/probes"),
        help="output folder (results/probes: the record)",
    )
    args = p.parse_args()
    if max(args.ns + [args.n]) > 64:
        raise SystemExit("error: n must be <= 64 (exact Jacobians of size (n*dim)^2)")
    ranges = parse_ranges(args.scale_ranges)

    by_scale = layer_table([args.n], args.scales, args.dim, args.dim, args.draws, args.seed)
    by_n = layer_table(args.ns, [args.scale], args.dim, args.dim, args.draws, args.seed + 1)
    scale_curve, n_curve = median_curve(by_scale, "scale"), median_curve(by_n, "n")
    scale_curve["sigma_over_mean_sq_norm"] = scale_curve.sigma / scale_curve.mean_sq_norm

    fmt = "{:.3g}".format
    print(f"== spectral norm vs input scale (n={args.n}, C=D={args.dim}, median of {args.draws})")
    print(scale_curve.to_string(index=False, float_format=fmt))
    print("\n== log-log slopes of sigma vs scale (scores grow ~ scale^2 without QK-LN)")
    scale_slopes = slope_table(scale_curve, "scale", ranges)
    print(scale_slopes.to_string(index=False, float_format=fmt))
    print()
    for (kind, qk_ln), g in scale_slopes.groupby(["kind", "qk_ln"]):
        parts = [
            f"{'grows' if r.slope > 0.1 else 'falls' if r.slope < -0.1 else 'flat'} "
            f"~scale^{r.slope:.2f} on [{r.lo:g}, {r.hi:g}]"
            for r in g.itertuples()
        ]
        print(f"{kind:7s} QK-LN {'on ' if qk_ln else 'off'}: " + "; ".join(parts))
    print(f"\n== spectral norm vs n (scale={args.scale})")
    print(n_curve.to_string(index=False, float_format=fmt))
    print("\n== log-log slopes of sigma vs n")
    n_range = [(min(args.ns), max(args.ns))]
    print(slope_table(n_curve, "n", n_range).to_string(index=False, float_format=fmt))

    args.out.mkdir(parents=True, exist_ok=True)
    pd.concat(
        [scale_curve.assign(sweep="scale", n=args.n), n_curve.assign(sweep="n", scale=args.scale)]
    ).to_csv(args.out / "attention_layer.csv", index=False)
    plot(scale_curve, n_curve, args.n, args.scale, args.out / "attention_layer.png")
    print(f"\nwrote {args.out / 'attention_layer.csv'} and {args.out / 'attention_layer.png'}")


if __name__ == "__main__":
    main()
