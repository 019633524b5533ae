"""The paper's stress test (section 5.3, A.2): paired softmax / sigmoid training of a ~160M
bidirectional encoder at 8,192 tokens, no gradient clipping, identical weights and data order.

    accelerate launch --config_file experiments/launch/single_gpu.yaml experiments/stress_8k.py
    accelerate launch --config_file experiments/launch/multi_gpu.yaml --num_processes 8 \\
        experiments/stress_8k.py --arm softmax
    python experiments/stress_8k.py --train.global_batch=32 --train.steps=300   # one GPU, bf16
    python experiments/stress_8k.py --preset smoke                # CPU-sized paired run (make demo)

Expected (the paper's claim, to be measured, not assumed): softmax's global grad norm explodes
(~1e2 -> 1.6e6) and its loss returns to ~10 near step 55K; sigmoid stays bounded for 80K steps.
The smoke preset learns within a few hundred steps on 2 CPU cores and both arms stay stable.

A rerun of the same command resumes from each arm's checkpoint (``--resume=force`` after a config
change, ``--fresh=True`` to start over). Exit status: 0 when every arm ran to its end (stable or
diverged: both are results), 75 when SIGTERM / SIGINT stopped the run after a
checkpoint (rerun to resume), 2 for a bad config, data or checkpoint (one ``error:`` line).
"""

import sys

from stabilitylab.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
