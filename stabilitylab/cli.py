"""Console entry points and the error guard every script wraps around its ``main``.

    stabilitylab-train --preset smoke          # = python experiments/stress_8k.py --preset smoke
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

from stabilitylab.config import CPU_PRESETS, ConfigError, parse
from stabilitylab.data.source import DataError

TRAIN_DESCRIPTION = (
    "Paired softmax / sigmoid training runs: a preset sets every default, --section.key=value "
    "overrides one; then the stability report over the arms."
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


def train_main(argv: list[str] | None = None) -> int:
    """The paired stress run (``experiments/stress_8k.py``): parse the config, train, report.

    Returns the exit code: 0 when every arm ran to its end (stable or diverged: both are
    results), ``EXIT_INTERRUPTED`` (75) when SIGTERM / SIGINT stopped it, 1 when no arm ran, 2
    for bad input or a GPU preset without CUDA.
    """
    with cli_errors():
        cfg = parse(argv, default_preset="stress_8k", description=TRAIN_DESCRIPTION)
        import torch

        if not torch.cuda.is_available() and cfg.preset not in CPU_PRESETS and not cfg.allow_cpu:
            print(
                f"error: preset {cfg.preset!r} needs a CUDA GPU and none is visible. "
                "On a CPU, run the CPU-sized preset: --preset smoke "
                "(or --allow_cpu=True to run this one slowly)",
                file=sys.stderr,
            )
            return USAGE_ERROR
        from stabilitylab.train import run  # after the checks: refuse at once, before heavy imports

        summaries = run(cfg)
    if any(s.get("interrupted_by_signal") for s in summaries.values()):
        return EXIT_INTERRUPTED
    return 0 if summaries else 1


def report_main(argv: list[str] | None = None) -> int:
    """The stability report over run directories (``analysis/report.py``)."""
    from stabilitylab.analysis.report import main

    return main(argv)


def sweep_main(argv: list[str] | None = None) -> int:
    """The LR-sweep summary over run directories (``analysis/sweep.py``)."""
    from stabilitylab.analysis.sweep import main

    return main(argv)
