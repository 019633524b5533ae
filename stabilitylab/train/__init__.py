"""The trainer: paired softmax / sigmoid arms on HF accelerate.

    from stabilitylab.train import run
    summaries = run(cfg)                 # {arm: summary}, then the report

Modules, in the order a step meets them:

    loop.py        run / train_arm: the arm's start, the loop (batch -> step -> telemetry ->
                   policy -> checkpoint), the end (summary); SIGTERM / SIGINT handling
    build.py       accelerator (mixed-precision rule, trackers), model, optimizer, lr schedule
    step.py        one optimizer step over the micro-batches, and its one host read
    policy.py      History; non-finite steps, the divergence rule, forensic checkpoints
    checkpoint.py  atomic checkpoints (weights, optimizer, every process's RNG, step, history)
    resume.py      fresh / resume / finished, and the config check on resume
    sharding.py    FSDP2 through accelerate: the settings it takes, sharded checkpoints (DCP)

The batches come from ``stabilitylab.data.loader``; monitors, MFU and trackers from
``stabilitylab.telemetry``; run dirs and summaries from ``stabilitylab.runs``.
"""

from stabilitylab.train.build import build_model, lr_at, make_optimizer
from stabilitylab.train.loop import run, train_arm

__all__ = ["build_model", "lr_at", "make_optimizer", "run", "train_arm"]
