"""Console entry points and the error guard every script wraps around its ``main``.

    stabilitylab-train --preset smoke          # = python experiments/stress_8k.py --preset smoke
    python experiments/kv_eviction.py --preset tiny     # kv_main: the KV-eviction study
    stabilitylab-kv-study --preset tiny        # = python experiments/kv_study.py: train + study
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
    "and batches, and on request their fine-tune controls (-ft: a gated cell from its trained "
    "dense backbone); a preset sets every default, --section.key=value overrides one, --cells "
    "picks cells; then the summary table and the report over the cells."
)
KV_STUDY_DESCRIPTION = (
    "The KV-eviction study in one command: train the cells not trained yet (a rerun resumes and "
    "skips finished cells), then evaluate them: dense decode-window perplexity (Table 1), the "
    "validation tau sweep (Table 5), tau* frozen and run on test against the dense backbone and "
    "H2O / KeyDiff at the matched budget (Table 2), decode wall-clock, Figure 1; written to "
    "<out_dir>/<name>/study/. The study.* keys set the windows and sizes."
)
USAGE_ERROR = 2
"""Exit code of a refused input (argparse and tyro use it too)."""
EXIT_INTERRUPTED = 75
"""sysexits.h EX_TEMPFAIL: SIGTERM / SIGINT stopped the run after a checkpoint; rerun to resume."""


def _input_errors() -> tuple[type[Exception], ...]:
    """Errors that mean bad input (config, data, checkpoint, resume), not a bug."""
    from stabilitylab.eviction.cells import StudyError
    from stabilitylab.runlock import RunBusy
    from stabilitylab.train.checkpoint import CheckpointError
    from stabilitylab.train.resume import ResumeError

    return (ConfigError, DataError, CheckpointError, ResumeError, StudyError, RunBusy)


@contextlib.contextmanager
def cli_errors() -> Iterator[None]:
    """Turn bad input (ConfigError, DataError, CheckpointError, ResumeError, StudyError, and
    RunBusy: the run is another process's) into ``error: <message>`` and ``SystemExit(2)``.

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
    study: str = "stress",
) -> int:
    """Parse the config, train every arm (or cell), report: the paired stress run
    (``experiments/stress_8k.py``) and, with ``study="kv"``, the KV-eviction study's cells. Each
    study's command takes its own presets and keys (``stabilitylab.study_cli``).

    Returns the exit code: 0 when every arm ran to its end (stable or diverged: both are
    results), ``EXIT_INTERRUPTED`` (75) when SIGTERM / SIGINT stopped it, 1 when no arm ran, 2
    for bad input or a GPU preset without CUDA.
    """
    with cli_errors():
        cfg = parse(argv, default_preset=default_preset, description=description, study=study)
        if not _device_ok(cfg):
            return USAGE_ERROR
        from stabilitylab.train import run  # after the checks: refuse at once, before heavy imports

        summaries = run(cfg)
    if any(s.get("interrupted_by_signal") for s in summaries.values()):
        return EXIT_INTERRUPTED
    return 0 if summaries else 1


def _device_ok(cfg) -> bool:
    """False (after one ``error:`` line) for a GPU preset on a machine without CUDA."""
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
        return False
    return True


def kv_main(argv: list[str] | None = None) -> int:
    """The KV-eviction study (``experiments/kv_eviction.py``): ``train_main`` with its presets'
    default (reduced) and description."""
    return train_main(argv, default_preset="reduced", description=KV_DESCRIPTION, study="kv")


def kv_study_main(argv: list[str] | None = None) -> int:
    """The KV-eviction study in one command (``experiments/kv_study.py``): train the cells not
    trained yet (resuming; finished cells are skipped), then, on the main process only, load
    them and write ``<out_dir>/<name>/study/``. Exit codes as ``kv_main``: 0, 2 (bad input, one
    ``error:`` line), 75 (stopped by a signal: the study is not run; rerun to resume)."""
    with cli_errors():
        cfg = parse(argv, default_preset="reduced", description=KV_STUDY_DESCRIPTION, study="kv")
        if not _device_ok(cfg):
            return USAGE_ERROR
        if cfg.task != "lm":
            raise ConfigError(
                f"config data.source: the KV-eviction study trains on text, got "
                f"{cfg.data.source!r} (preset {cfg.preset!r}); pick --preset tiny, reduced or paper"
            )
        if cfg.study.parallel:
            from stabilitylab.eviction.pairs import run_pairs
            from stabilitylab.train.warmstart import check_sources

            check_sources(cfg)  # an -ft cell's backbone, train.init_from: before any process

            code, study_md = run_pairs(sys.argv[1:] if argv is None else argv, cfg)
            if study_md is not None:
                print(f"study: {study_md}")
            return code
        from stabilitylab import runs

        # The cells and the study folder stay this process's from the training to study.md.
        with runs.hold([*(runs.arm_dir(cfg, c) for c in cfg.arms()), runs.study_dir(cfg)]):
            return _train_and_study(cfg)
    return 0


def _train_and_study(cfg) -> int:
    import torch
    from accelerate import PartialState

    from stabilitylab.train import run

    main = PartialState(cpu=not torch.cuda.is_available()).is_main_process
    summaries = run(cfg)
    if any(s.get("interrupted_by_signal") for s in summaries.values()):
        return EXIT_INTERRUPTED
    if not main:
        return 0
    from stabilitylab.analysis.kv_study import study_report

    paths = study_report(cfg, progress=True)
    print(f"study: {paths['study.md']}")
    return 0


def report_main(argv: list[str] | None = None) -> int:
    """The stability report over run directories (``analysis/report.py``)."""
    from stabilitylab.analysis.report import main

    return main(argv)


def sweep_main(argv: list[str] | None = None) -> int:
    """The LR-sweep summary over run directories (``analysis/sweep.py``)."""
    from stabilitylab.analysis.sweep import main

    return main(argv)
