"""Jacobian of the score map alone: softmax(s) vs sigmoid(s - log n), one row of scores.

    python experiments/probes/score_map.py            # ~20 s on a laptop CPU; writes runs/probes/score_map.{csv,png}

Expected: sigmoid's Jacobian is diagonal (off-diagonal entries exactly 0) with entries <= 1/4;
softmax's is dense and equals diag(p) - p p^T to rounding. Both spectral norms stay bounded as the
scores grow (softmax's by 1/2, sigmoid's by 1/4), and softmax's collapses towards 0 once one
score dominates the row: the score map itself does not blow up, for either kind.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import seaborn as sns
import torch

from stabilitylab.probes.jacobian import exact_jacobian, score_probs
from stabilitylab.probes.sweeps import score_map_summary, score_map_table


def plot(df, heat_n: int, heat_scale: float, seed: int, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    sns.lineplot(df, x="scale", y="sigma", hue="kind", style="n", errorbar=("pi", 100), ax=axes[0])
    axes[0].set(xscale="log", yscale="log", xlabel="score scale (s = scale * z, z ~ N(0,1))",
                ylabel="||dp/ds||_2 (exact)", title="Score-map Jacobian norm (band: min-max)")  # fmt: skip
    axes[0].set_ylim(1e-4, 1.0)  # saturated rows reach 1e-30: below plotting interest
    axes[0].axhline(0.25, color="grey", lw=0.8, ls="--")
    axes[0].axhline(0.5, color="grey", lw=0.8, ls=":")
    s_N = torch.randn(heat_n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    s_N = s_N * heat_scale
    for ax, kind in zip(axes[1:], ("softmax", "sigmoid"), strict=True):
        J = exact_jacobian(lambda s, k=kind: score_probs(s, k), s_N).numpy()
        lim = np.abs(J).max()
        im = ax.imshow(J, cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set_title(f"{kind}: dp/ds, n={heat_n}, scale={heat_scale}")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ns", type=int, nargs="+", default=[16, 64])
    p.add_argument("--scales", type=float, nargs="+", default=list(np.logspace(-1, 2, 13)))
    p.add_argument("--rows", type=int, default=5, help="random score rows per (n, scale)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=Path("runs/probes"),
        help="output folder (results/probes: the record)",
    )
    args = p.parse_args()
    if max(args.ns) > 64 or min(args.ns) < 2:
        raise SystemExit("error: --ns must lie in [2, 64] (exact Jacobians at toy sizes)")
    df = score_map_table(args.ns, args.scales, args.rows, args.seed)
    table = score_map_summary(df)
    with np.printoptions(precision=3):
        print(table.to_string(index=False, float_format="{:.3g}".format))
    sig, soft = df[df.kind == "sigmoid"], df[df.kind == "softmax"]
    print(f"\nsigmoid: max off-diagonal |J_ij| = {sig.max_offdiag.max():.3g} (diagonal: "
          f"{bool((sig.max_offdiag == 0).all())}); max entry = {sig.max_entry.max():.6f} (<= 1/4: "
          f"{bool((sig.max_entry <= 0.25).all())})")  # fmt: skip
    print(f"softmax: max |J - (diag(p) - p p^T)| = {soft.closed_form_err.max():.3g}; "
          f"max off-diagonal |J_ij| = {soft.max_offdiag.max():.3g} (dense); "
          f"max ||J||_2 = {soft.sigma.max():.4f} (<= 1/2)")  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "score_map.csv", index=False)
    plot(df, heat_n=16, heat_scale=3.0, seed=args.seed, path=args.out / "score_map.png")
    print(f"wrote {args.out / 'score_map.csv'} and {args.out / 'score_map.png'}")


if __name__ == "__main__":
    main()
