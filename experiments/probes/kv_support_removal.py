"""Random support removal on the trained cells of a KV-eviction run (the paper's Figure 2).

    python experiments/probes/kv_support_removal.py --run runs/kv_tiny    # CPU, seconds
    python experiments/probes/kv_support_removal.py --run runs/kv_reduced \\
        --cells sm-rope sig-rope                                          # the paper's backbones

Per layer, a random fraction p of each sequence's K/V positions (the first four kept) loses its
logits and values; the perturbation is ||O~ - O||_F / ||O||_F of the layer's attention output,
averaged over --windows test sequences drawn across the split, for the isolated protocol (one
layer at a time) and the paper's compound one (removal at every layer in a second forward pass).
Prints the mean over layers per cell, protocol and p; writes support_removal{,_summary}.csv and
support_removal.png under --out (default <run>/probes).

Expected (the paper: 12 x 768 dense RoPE backbones, 50 test sequences, compound): softmax vs
sigmoid 0.574 vs 0.579 at p = 0.1, 0.943 vs 1.051 at 0.3, 1.131 vs 3.666 at 0.5. A 2-layer tiny
run gives smaller numbers; at p = 0 every perturbation is exactly 0.
"""

from __future__ import annotations

import argparse

import kv_run  # the scripts' shared flags and loading (this folder)

from stabilitylab.analysis.kv_figures import figure_perturbation
from stabilitylab.probes.model_probes import PROTOCOLS, support_removal_tables


def parse_args() -> argparse.Namespace:
    p = kv_run.parser(__doc__, windows=50)
    p.add_argument("--ps", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    p.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    r = kv_run.open_run(args)
    out, models, tokens_BT, lengths_B = r.out, r.models, r.tokens_BT, r.lengths_B
    tables = support_removal_tables(
        models, tokens_BT, lengths_B, args.ps, args.seed, args.protocols, args.batch_size
    )
    kv_run.write_tables(tables, out)
    wide = tables["support_removal_summary"].pivot_table(
        index=["protocol", "p"], columns="cell", values="perturbation", sort=False
    )
    print(f"{len(lengths_B)} {args.split} windows; perturbation, mean over layers:")
    print(wide.to_string(float_format="%.3f"))
    path = figure_perturbation(tables["support_removal"], out / "support_removal.png")
    print(f"wrote {out}/support_removal.csv, {out}/support_removal_summary.csv, {path}")


if __name__ == "__main__":
    main()
