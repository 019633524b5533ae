"""Row-sum CV and gate binarization of the trained cells of a KV-eviction run (Figure 3).

    python experiments/probes/kv_row_sum.py --run runs/kv_tiny            # CPU, seconds
    python experiments/probes/kv_row_sum.py --run runs/kv_reduced          # every test window

Row-sum CV: per (sequence, layer, head), std / mean over query positions of the row sums of the
attention weights (the gate's key bias included), then averaged; 0 for softmax by construction
(float64 rounding, ~1e-16, here). Binarization: the fraction of a gate layer's gates below 0.05
or above 0.95. Prints the per-layer table and the means over layers; writes
rowsum_binarization{,_summary}.csv and rowsum_binarization.png under --out (default
<run>/probes).

Expected (the paper, 1953 test sequences of 512): row-sum CV 0.484 (Sig+G RoPE), 0.444
(Sig+G NoPE), 0 for softmax; binarization 43.3% (Sig+G NoPE), 36.8% (SM+G RoPE), 24.4%
(Sig+G RoPE). The tiny run's gates barely leave sigmoid(5) = 0.993, so they are all > 0.95.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from stabilitylab.analysis.kv_figures import figure_rowsum_binarization
from stabilitylab.eviction.cells import load_cells
from stabilitylab.probes.model_probes import rowsum_binarization_tables
from stabilitylab.probes.probe_text import cell_windows


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", type=Path, required=True, help="a run dir holding cell dirs")
    p.add_argument("--out", type=Path, default=None, help="default: <run>/probes")
    p.add_argument("--cells", nargs="+", default=None, help="default: every trained cell")
    p.add_argument("--split", default="test", choices=["val", "test"])
    p.add_argument("--windows", type=int, default=None, help="default: every window of the split")
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
    tables = rowsum_binarization_tables(models, tokens_BT, lengths_B, args.batch_size)
    out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
    columns = ["cell", "layer", "row_sum_cv", "gate_mean", "binarization"]
    print(f"{len(lengths_B)} {args.split} windows; per layer:")
    print(tables["rowsum_binarization"][columns].to_string(index=False, float_format="%.4g"))
    print("mean over layers:")
    print(tables["rowsum_binarization_summary"].to_string(index=False, float_format="%.4g"))
    path = figure_rowsum_binarization(
        tables["rowsum_binarization"], out / "rowsum_binarization.png"
    )
    print(f"wrote {out}/rowsum_binarization*.csv, {path}")


if __name__ == "__main__":
    main()
