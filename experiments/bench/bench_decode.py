"""Decode speed of the engine (paged KV, the decode kernel, CUDA-graph steps) against dense
decode through SDPA and FlexAttention over a contiguous cache (issue 40).

    python experiments/bench/bench_decode.py --sizes reduced --out runs/bench_decode_reduced
    python experiments/bench/bench_decode.py --sizes paper --out runs/bench_decode_paper
    python experiments/bench/bench_decode.py --smoke --out runs/bench_decode_smoke   # CPU, seconds
    python experiments/bench/bench_decode.py --run runs/kv_reduced --out runs/bench_decode_cells

Grid: contexts 1K-32K, compression 0 / 25 / 50 / 75 / 90% (per-row live counts drawn to the
target), batch 1 and 32, bf16, random weights of the KV study's reduced (6 x 384) and paper
(12 x 768) decoders, gated; ``--run DIR`` times a trained study's gated cells at tau* instead
(its decode-speed table through the engine, on the test windows and split of the cells' own
config; with --sizes the grid runs first). Writes decode.csv, decode_bars.csv, decode.md (and
cells.csv) under --out and prints the tables. What is measured and how:
stabilitylab/inference/bench.py. Expected: no number yet (the first GPU run sets them).
"""

from stabilitylab.inference.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
