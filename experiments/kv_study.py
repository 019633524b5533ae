"""The KV-eviction study in one command: train the 8 cells (or those of --cells) where they are
not trained yet, then evaluate them and write the tables and Figure 1 of "Sigmoid Attention as a
Better Substrate for Learned KV Cache Eviction".

    python experiments/kv_study.py --preset tiny                    # CPU (make kv-study)
    accelerate launch --config_file experiments/launch/single_gpu.yaml experiments/kv_study.py \\
        --preset reduced                                            # one H200, needs `make data`
    python experiments/kv_study.py --preset tiny --study.val_windows=2 --study.batch_size=4
    python experiments/kv_study.py --preset tiny --help             # every key, study.* included

Training is experiments/kv_eviction.py's (same presets, --cells and --section.key overrides; a
rerun resumes and skips finished cells; the study.* keys never make a trained cell refuse to
resume). Then, on the main process only: each gated cell's tau is swept on validation (15
points), tau* = the highest compression whose Delta ln PPL to its own tau = 0 is <= 0.0045
(``study.tau_rule``; the paper's absolute 0.1 PPL is an option), frozen and run on test; its dense
backbone (SM+G-RoPE -> SM-RoPE, ...) and H2O / KeyDiff on that backbone, held step by step to the
gate's live entries (``study.baselines``), run on the same test windows, each window's NLL kept
for the paired intervals. A fine-tune control in --cells
(sig-g-rope-ft: sig-g-rope started from the trained sig-rope) is trained after its backbone and
studied as a gated cell on that backbone; --study.parallel=True trains it in its backbone's
process, after it. Output: runs/<name>/study/
(table1, table2, table5, decode_speed as .md and .csv, fig1_ppl_vs_compression.png, study.md).

Decode speed: each gated cell on test at tau* and at tau = 0, --study.timing_repeats runs of each
(default 3, alternating), the median seconds with min / max and the speedup of the medians. With
--study.parallel=True (a process per dense / gated pair on the one GPU) the pairs' processes do
not time (--study.timing=False is passed to them): the parent times every gated cell alone on the
GPU once they have all ended, at the tau* of the joined table2 (frozen on validation), and
rewrites decode_speed and study.md; the ``measured_alone`` column records it.

Expected on tiny (measured, 2 CPU cores, 2026-12-02): about 30 s of training and 10 s of study
on idle cores (6 min with the cores shared); the gates stay near sigmoid(5) = 0.993, above every
grid point, so tau* = 0 and compression 0 for each gated cell (nothing to evict at this size);
the baselines at that full budget equal the dense backbone; decode-window test PPL 400-500 (with
the gate recipe, 2026-12-07: 329-398, tau* = 0 still). The paper, at its scale: Sig+G RoPE
deletes 19.8% of the cache at PPL 22.42 vs dense 22.44, Sig+G NoPE 32.2% at 24.64 vs 24.60.

Exit status: 0 when the study was written, 75 when SIGTERM / SIGINT stopped the training after a
checkpoint (rerun to resume; no study), 2 for bad input (one ``error:`` line).
"""

import sys

from stabilitylab.cli import kv_study_main

if __name__ == "__main__":
    sys.exit(kv_study_main())
