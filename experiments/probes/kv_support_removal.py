"""Random support removal on the trained cells of a KV-eviction run (the paper's Figure 2).

    python experiments/probes/kv_support_removal.py --run runs/kv_tiny    # CPU, seconds
    python experiments/probes/kv_support_removal.py --run runs/kv_reduced \\
        --cells sm-rope sig-rope                                          # the paper's backbones

Per layer, a random fraction p of each sequence's K/V positions (the first four kept) loses its
logits and values; the perturbation is ||O~ - O||_F / ||O||_F of the layer's attention output,
averaged over --windows test sequences, for the isolated protocol (one layer at a time) and the
paper's compound one (removal at every layer in a second forward pass). Prints the mean over
layers per cell, protocol and p; writes support_removal{,_summary}.csv and support_removal.png
under --out (default <run>/probes).

Expected (the paper: 12 x 768 dense RoPE backbones, 50 test sequences, compound): softmax vs
sigmoid 0.574 vs 0.579 at p = 0.1, 0.943 vs 1.051 at 0.3, 1.131 vs 3.666 at 0.5. A 2-layer tiny
run gives smaller numbers; at p = 0 every perturbation is exactly 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from stabilitylab.analysis.kv_figures import figure_perturbation
from stabilitylab.eviction.cells import load_cells
from stabilitylab.probes.model_probes import PROTOCOLS, support_removal_tables
from stabilitylab.probes.probe_text import cell_windows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", type=Path, required=True, help="a run dir holding cell dirs")
    p.add_argument("--out", type=Path, default=None, help="default: <run>/probes")
    p.add_argument("--cells", nargs="+", default=None, help="default: every trained cell")
    p.add_argument("--split", default="test", choices=["val", "test"])
    p.add_argument("--windows", type=int, default=50, help="evaluation windows (the paper: 50)")
    p.add_argument("--ps", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    p.add_argument("--protocols", nargs="+", default=list(PROTOCOLS), choices=PROTOCOLS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    out = args.out or args.run / "probes"
    cells = load_cells(args.run, args.cells, args.device)
    data_cfg = next(iter(cells.values())).config.data
    tokens_BT, lengths_B, _ = cell_windows(
        args.run, list(cells), data_cfg, args.split, args.windows
    )
    models = {name: c.model for name, c in cells.items()}
    tables = support_removal_tables(
        models, tokens_BT, lengths_B, args.ps, args.seed, args.protocols, args.batch_size
    )
    out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
    wide = tables["support_removal_summary"].pivot_table(
        index=["protocol", "p"], columns="cell", values="perturbation", sort=False
    )
    print(f"{len(lengths_B)} {args.split} windows; perturbation, mean over layers:")
    print(wide.to_string(float_format="%.3f"))
    path = figure_perturbation(tables["support_removal"], out / "support_removal.png")
    print(f"wrote {out}/support_removal.csv, {out}/support_removal_summary.csv, {path}")


if __name__ == "__main__":
    main()
