"""The KV-eviction study, training side: 8 cells of a GPT-2-style causal decoder, softmax /
sigmoid attention (SM, Sig) x dense / learned KV-eviction gates (+G) x RoPE / NoPE, from the same
initial weights where their parameters coincide and on the same batches (the paper: "Sigmoid
Attention as a Better Substrate for Learned KV Cache Eviction").

    python experiments/kv_eviction.py --preset tiny                 # CPU, all 8 cells (make kv-demo)
    accelerate launch --config_file experiments/launch/single_gpu.yaml experiments/kv_eviction.py \\
        --preset reduced                                            # one H200, needs `make data`
    python experiments/kv_eviction.py --preset tiny --cells sm-rope sig-g-rope   # a subset
    python experiments/kv_eviction.py --preset tiny --help          # every key, presets, cells

Cells: sm-rope sig-rope sm-g-rope sig-g-rope sm-nope sig-nope sm-g-nope sig-g-nope (the paper's
SM, Sig, SM+G, Sig+G, each RoPE / NoPE). On request, the fine-tune controls sm-g-rope-ft
sig-g-rope-ft sm-g-nope-ft sig-g-nope-ft: the gated cell started from its dense backbone's trained
weights (gates at w = 0, b = 5) for --train.finetune_steps steps (default a quarter of
train.steps), the backbone listed before it or trained already:

    python experiments/kv_eviction.py --preset tiny --cells sig-rope sig-g-rope-ft

The presets train with the gate recipe (per-gate lambda, lambda ramped in, cosine lr, gates not
decayed; stabilitylab/presets.py says where each comes from); --train.budget_norm=mean
--train.budget_ramp=0 --train.lr_decay=none --train.gate_weight_decay=True is the paper's literal
form. Runs go to runs/<name>/<cell>/ (name: kv_tiny,
kv_reduced, kv_paper), then the summary table (validation perplexity, gate mean and
binarization per cell) and the report over the cells (runs/<name>/report/).

Expected on tiny (measured, 2 CPU cores, ~30 s for the 8 cells on idle cores): every cell's
training CE falls from 6.4 (ln 595) to 3.3-3.5 and its validation perplexity from ~597 to
199-217; the gated cells' gates leave 0.9933 (sigmoid(5)) slowly (0.9930-0.9932 at the end), as
the budget term pushes them down. The paper, at its scale: dense softmax beats dense sigmoid by 0.36
(RoPE) and 1.2 (NoPE) perplexity, and the gated sigmoid cells delete 20-32% of the cache at
nearly dense perplexity (eviction at inference is not built here).

A rerun resumes each cell from its checkpoint and skips finished cells (``--resume=force`` after
a config change, ``--fresh=True`` to start over). Exit status: 0 when every cell ran to its end,
75 when SIGTERM / SIGINT stopped the run after a checkpoint (rerun to resume), 2 for a bad config,
missing data or a bad checkpoint (one ``error:`` line).
"""

import sys

from stabilitylab.cli import kv_main

if __name__ == "__main__":
    sys.exit(kv_main())
