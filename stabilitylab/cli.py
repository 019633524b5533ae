"""Console entry points and the error guard every script wraps around its ``main``.

    stabilitylab-train --preset smoke          # = python experiments/stress_8k.py --preset smoke
    python experiments/kv_eviction.py --preset tiny     # kv_main: the KV-eviction study
    stabilitylab-report runs/smoke             # = python analysis/report.py runs/smoke
    stabilitylab-sweep runs/                   # = python analysis/sweep.py runs/

Bad input (a config value, a data file) ends the program with one line ``error: <what, which
key or file>`` on stderr and exit code 2, before any training; anything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from stabilitylab.config import ConfigError, parse
from stabilitylab.data.source import DataError

TRAIN_DESCRIPTION = (
    "Paired softmax / sigmoid training runs: a preset sets every default, --section.key=value "
    "overrides one; then the stability report over the arms."
)
KV_DESCRIPTION = (
    "The KV-eviction study: a causal decoder on text in up to 8 cells (softmax / sigmoid "
    "attention x dense / learned KV-eviction gates x RoPE / NoPE) from the same initial weights "
    "and batches; a preset sets every default, --section.key=value overrides one, --cells picks "
    "cells; then the summary table and the report over the cells."
)
USAGE_ERROR = 2
"""Exit code of a refused input (argparse and tyro use it too)."""
EXIT_INTERRUPTED = 75
"""sysexits.h EX_TEMPFAIL: SIGTERM / SIGINT stopped the run after a checkpoint; rerun to resume."""


def _input_errors() -> tuple[type[Exception], ...]:
    """Errors that mean bad input (config, data, checkpoint, resume), not a bug."""
    from stabilitylab.train.checkpoint import CheckpointError
    from stabilitylab.train.resume import ResumeError

    return (ConfigError, DataError, CheckpointError, ResumeError)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn bad input (ConfigError, DataError, CheckpointError, ResumeError) into
    ``error: <message>`` and ``SystemExit(2)``.

    A context manager and a decorator::

        with cli_errors():
            run(parse())

        @cli_errors()
        def main(): ...
    """
    try:
        yield
    except _input_errors() as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_ERROR) from None


def train_main(
    argv: list[str] | None = None,
    *,
    default_preset: str = "stress_8k",
    description: str = TRAIN_DESCRIPTION,
) -> int:
    """Parse the config, train every arm (or cell), report: the paired stress run
    (``experiments/stress_8k.py``) and, with another default preset, the KV-eviction study.

    Returns the exit code: 0 when every arm ran to its end (stable or diverged: both are
    results), ``EXIT_INTERRUPTED`` (75) when SIGTERM / SIGINT stopped it, 1 when no arm ran, 2
    for bad input or a GPU preset without CUDA.
    """
    with cli_errors():
        cfg = parse(argv, default_preset=default_preset, description=description)
        import torch

        from stabilitylab.presets import CPU_PRESETS

        if not torch.cuda.is_available() and cfg.preset not in CPU_PRESETS and not cfg.allow_cpu:
            cpu_preset = "tiny" if cfg.task == "lm" else "smoke"
            print(
                f"error: preset {cfg.preset!r} needs a CUDA GPU and none is visible. "
                f"On a CPU, run the CPU-sized preset: --preset {cpu_preset} "
                "(or --allow_cpu=True to run this one slowly)",
                file=sys.stderr,
            )
            return USAGE_ERROR
        from stabilitylab.train import run  # after the checks: refuse at once, before heavy imports

        summaries = run(cfg)
    if any(s.get("interrupted_by_signal") for s in summaries.values()):
        return EXIT_INTERRUPTED
    return 0 if summaries else 1


def kv_main(argv: list[str] | None = None) -> int:
    """The KV-eviction study (``experiments/kv_eviction.py``): ``train_main`` with its presets'
    default (reduced) and description."""
    return train_main(argv, default_preset="reduced", description=KV_DESCRIPTION)


def report_main(argv: list[str] | None = None) -> int:
    """The stability report over run directories (``analysis/report.py``)."""
    from stabilitylab.analysis.report import main

    return main(argv)


def sweep_main(argv: list[str] | None = None) -> int:
    """The LR-sweep summary over run directories (``analysis/sweep.py``)."""
    from stabilitylab.analysis.sweep import main

    return main(argv)
