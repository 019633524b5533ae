"""The study's cells in parallel: one process per dense / gated pair, then one joined study.

    accelerate launch --config_file experiments/launch/single_gpu.yaml experiments/kv_study.py \\
        --preset reduced --study.parallel=True

Each pair (``sm-rope`` with ``sm-g-rope``, ...; a cell whose partner is not asked for goes alone)
runs the same command with ``--cells <pair> --study.parallel=False --study.timing=False
--study.out_dir=<run dir>/study-<first cell>``, its output in ``<run dir>/study-<first cell>.log``; the children
inherit the launcher's environment (mixed precision, the visible GPU). The children do not time
the decode (``--study.timing=False``): each would time while the others train or evaluate on the
same GPU. When every child has finished, their studies are joined into ``study.out_dir`` (default
``<run dir>/study``) by ``analysis.kv_study.merge_studies``; then this process, alone on the GPU,
times each gated cell at the tau* of the joined table2 (``analysis.kv_study.time_study``;
``study.timing_repeats`` alternating runs) and rewrites decode_speed and study.md. A child that
fails is named with its exit code and log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from stabilitylab.config import ConfigError, cell_settings
from stabilitylab.eviction.cells import dense_backbone

CHILD = "import sys; from stabilitylab.cli import kv_study_main; sys.exit(kv_study_main())"


def cell_groups(cells: Sequence[str]) -> list[list[str]]:
    """The cells in pairs (dense backbone first, its gated cell second, then its -ft cell, which
    starts from the backbone's weights and so trains after it in the same process), in
    ``cells``' order of first appearance; a cell without its partner is a group of one."""
    groups: dict[str, list[str]] = {}
    for cell in cells:
        groups.setdefault(dense_backbone(cell), []).append(cell)
    return [sorted(g, key=lambda c: cell_settings(c)[1]) for g in groups.values()]


def child_argv(argv: Sequence[str], group: Sequence[str], out_dir: Path) -> list[str]:
    """This command's arguments for one group: its cells, its own study folder, not parallel,
    no timing (the parent times alone after every child; later flags override earlier ones)."""
    return [
        *argv, "--cells", *group, "--study.parallel=False", "--study.timing=False",
        f"--study.out_dir={out_dir}",
    ]  # fmt: skip


def run_pairs(argv: Sequence[str], cfg) -> tuple[int, Path | None]:
    """Every group's process at once, their studies joined, then the decode timed here alone
    (with ``study.timing``); ``(exit code, joined study.md or None)``. The code is the first
    failing child's (0 when all ran)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "config study.parallel: one process per pair of cells on one GPU; launch it as one "
            "process (no --num_processes > 1), or drop study.parallel for a multi-process run"
        )
    from stabilitylab import runlock
    from stabilitylab.runs import study_dir

    run_dir = Path(cfg.out_dir) / cfg.name
    joined = study_dir(cfg)
    # The joined study is this process's before a log is opened; each child holds its cells.
    with runlock.hold([joined]):
        return _run_children(argv, cfg, run_dir, joined)


def _run_children(argv: Sequence[str], cfg, run_dir: Path, joined: Path) -> tuple[int, Path | None]:
    from stabilitylab.analysis.kv_study import merge_studies, time_study

    run_dir.mkdir(parents=True, exist_ok=True)
    children = []
    for group in cell_groups(cfg.cells):
        out = run_dir / f"study-{group[0]}"
        log = open(run_dir / f"study-{group[0]}.log", "w")  # noqa: SIM115 - closed below
        cmd = [sys.executable, "-c", CHILD, *child_argv(argv, group, out)]
        children.append((group, out, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))  # fmt: skip
        print(f"[{' '.join(group)}] started: log {log.name}", flush=True)
    failed = []
    for group, _, log, proc in children:
        code = proc.wait()
        log.close()
        if code != 0:
            failed.append((code, f"[{' '.join(group)}] exit code {code}: see {log.name}"))
    if failed:
        print("\n".join(msg for _, msg in failed), file=sys.stderr)
        return failed[0][0], None
    paths = merge_studies([out for _, out, _, _ in children], joined)
    if cfg.study.timing:
        print(f"every pair ended; timing the decode alone, into {joined}", flush=True)
        paths = time_study(cfg, joined)
    return 0, paths["study.md"]
