"""The paper's stress test (section 5.3, A.2): paired softmax / sigmoid training of a ~160M
bidirectional encoder at 8,192 tokens, no gradient clipping, identical weights and data order.

    accelerate launch experiments/stress_8k.py                    # both arms, one GPU or many
    accelerate launch experiments/stress_8k.py --arm softmax      # one arm
    accelerate launch experiments/stress_8k.py --train.global_batch=32 --train.steps=300
    python experiments/stress_8k.py --preset smoke                # CPU-sized paired run (make demo)

Expected (the paper's claim, to be measured, not assumed): softmax's global grad norm explodes
(~1e2 -> 1.6e6) and its loss returns to ~10 near step 55K; sigmoid stays bounded for 80K steps.
The smoke preset learns within a few hundred steps on 2 CPU cores and both arms stay stable.
"""

import sys

import torch

from stabilitylab.config import parse

CPU_PRESETS = ("smoke",)


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv, default_preset="stress_8k")
    if not torch.cuda.is_available() and cfg.preset not in CPU_PRESETS and not cfg.allow_cpu:
        print(
            f"error: preset {cfg.preset!r} needs a CUDA GPU and none is visible. "
            "On a CPU, run the CPU-sized preset: python experiments/stress_8k.py --preset smoke",
            file=sys.stderr,
        )
        return 2
    from stabilitylab.train import run  # after the check: refuse at once, before heavy imports

    summaries = run(cfg)
    return 0 if summaries else 1


if __name__ == "__main__":
    sys.exit(main())
