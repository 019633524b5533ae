"""Row-sum CV and gate binarization of the trained cells of a KV-eviction run (Figure 3).

    python experiments/probes/kv_row_sum.py --run runs/kv_tiny            # CPU, seconds
    python experiments/probes/kv_row_sum.py --run runs/kv_reduced          # every full test window

Row-sum CV: per (sequence, layer, head), std / mean over query positions of the row sums r_i of
the attention weights (the gate's key bias included), then averaged: row_sum_cv_norm (headline)
of r_i / n_i under sigmoid (n_i = i + 1 visible keys; r_i under softmax), row_sum_cv_raw of r_i
(probes/rowsum.py; equal logits alone give 0.576 at L = 512 under b = -log L); 0 for softmax in
both (float64 rounding, ~1e-16, here). Binarization: the fraction of a gate layer's gates below
0.05 or above 0.95. Prints the per-layer table and the means over layers; writes
rowsum_binarization{,_summary}.csv and rowsum_binarization.png under --out (default
<run>/probes).

Expected (the paper, 1953 test sequences of 512, raw r_i, its sigmoid bias not stated): row-sum
CV 0.484 (Sig+G RoPE), 0.444 (Sig+G NoPE), 0 for softmax; binarization 43.3% (Sig+G NoPE),
36.8% (SM+G RoPE), 24.4% (Sig+G RoPE). The tiny run's gates barely leave sigmoid(5) = 0.993, so
they are all > 0.95.
"""

from __future__ import annotations

import argparse

import kv_run  # the scripts' shared flags and loading (this folder)

from stabilitylab.analysis.kv_figures import figure_rowsum_binarization
from stabilitylab.probes.model_probes import rowsum_binarization_tables


def parse_args() -> argparse.Namespace:
    p = kv_run.parser(__doc__, windows=None)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    r = kv_run.open_run(args)
    out, models, tokens_BT, lengths_B = r.out, r.models, r.tokens_BT, r.lengths_B
    tables = rowsum_binarization_tables(models, tokens_BT, lengths_B, args.batch_size)
    kv_run.write_tables(tables, out)
    columns = ["cell", "layer", "row_sum_cv_norm", "row_sum_cv_raw", "gate_mean", "binarization"]
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
