"""Mean learned gate per token category, and the extreme tokens, of a run's gated cells (Table 4).

    python experiments/probes/kv_gate_categories.py --run runs/kv_tiny     # CPU, seconds
    python experiments/probes/kv_gate_categories.py --run runs/kv_reduced --min-count 20

Each valid test position's gate (averaged over the gate layers) goes to its token's category:
content, stopword, punctuation, newline, whitespace, digits (probes/token_categories.py gives
the rules; end-of-text is left out). Needs the GPT-2 tokenizer file (`make data` fetches it) to
decode the ids; a compact vocabulary is mapped back to GPT-2 ids first. Dense cells are skipped.
Prints the category table (cells as columns) and the lowest / highest-gate tokens; writes
table4_categories.csv, extreme_tokens.csv and gate_categories.png under --out (default
<run>/probes).

Expected (the paper, all four gated cells): stopwords and newlines get the lowest gates,
whitespace the highest (Sig+G NoPE: stopwords 0.178, content 0.281, whitespace 0.455); low-gate
tokens include the, a, an, The, It. The tiny run's gates are still ~0.992 everywhere.
"""

from __future__ import annotations

import argparse

import kv_run  # the scripts' shared flags and loading (this folder)

from stabilitylab.analysis.kv_figures import figure_gate_categories
from stabilitylab.probes.model_probes import gate_category_tables
from stabilitylab.probes.probe_text import gpt2_pieces_fn


def parse_args() -> argparse.Namespace:
    p = kv_run.parser(__doc__, windows=None, cells_help="every trained gated cell")
    p.add_argument("--k", type=int, default=10, help="extreme tokens at each end")
    p.add_argument("--min-count", type=int, default=5, help="least occurrences of a ranked token")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    r = kv_run.open_run(args, gated_only=True)
    out, tokens_BT, lengths_B = r.out, r.tokens_BT, r.lengths_B
    tables = gate_category_tables(
        r.models, tokens_BT, lengths_B, gpt2_pieces_fn(r.vocab), args.k, args.min_count, args.batch_size,
    )  # fmt: skip
    kv_run.write_tables(tables, out)
    table4 = tables["table4_categories"]
    print(f"{len(lengths_B)} {args.split} windows; mean gate per category (count in brackets):")
    labels = [f"{g:.3f} ({n})" for g, n in zip(table4["mean_gate"], table4["count"], strict=True)]
    wide = table4.assign(cell_gate=labels).pivot(
        index="category", columns="cell", values="cell_gate"
    )
    print(wide.loc[table4["category"].unique(), table4["cell"].unique()].to_string())
    extremes = tables["extreme_tokens"].assign(piece=lambda d: d["piece"].map(repr))
    print(extremes.to_string(index=False, float_format="%.3f"))
    path = figure_gate_categories(table4, out / "gate_categories.png")
    print(f"wrote {out}/table4_categories.csv, {out}/extreme_tokens.csv, {path}")


if __name__ == "__main__":
    main()
