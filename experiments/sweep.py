"""Run a grid of single-arm runs side by side on one GPU (small models leave an H200 mostly idle),
then summarise them with analysis/sweep.py.

    PYTHONPATH=. python3 experiments/sweep.py --name lr_sweep --preset proxy \
        --lr 1e-4 3e-4 1e-3 3e-3 1e-2 --arms softmax sigmoid --qk-ln False True --seeds 1 2 \
        --parallel 16 -- --train.steps=1000

Each run is `experiments/stress_8k.py --arm A --name <name>__<tag>` with its overrides, so every
run is an ordinary run directory (config, provenance, events, summary.json) at
<out_dir>/<name>__<tag>/<arm>/, tag = lr<lr>_qk<0|1>_s<seed>[_r<k>].
Expected (Wortsman et al. 2023): without QK-LayerNorm the final loss rises at high lr; with it the
curve is flatter. Whether sigmoid behaves like softmax here is what the sweep measures.

Outcome rates instead of single draws: ``--repeats K`` runs each grid point K times, with seeds
s, s+1, ..., s+K-1 for every --seeds s, or with ``--same_seed`` K times with the seed s itself
(tag ``..._s<s>_r<k>``, k = 0..K-1): where the backend is not bit-reproducible (SDPA's backward at
lr 0.1 in docs/RESULTS.md, 3a) the outcome of one seed is itself a draw. The report groups
repeats by their resolved config (same arm, same config but for the seed and names), not by the
run names, and writes per arm the fraction diverged with its 95% Wilson interval, the divergence
steps and the early warning across repeats to <out_dir>/<name>__rates/:

    PYTHONPATH=. python3 experiments/sweep.py --name rep --preset diverge_fast --lr 0.1 \
        --arms softmax --seeds 1 --repeats 8 --same_seed --parallel 8 -- \
        --softmax_backend=softmax --train.checkpoint_every=0
    # expected (3a): seed 1 through SDPA diverged in 3 of 6 runs: a rate near 1/2, interval +-0.3

``--dry_run`` prints the runs without starting them.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def run_seeds(seeds: list[int], repeats: int, same_seed: bool) -> list[tuple[int, int | None]]:
    """``(seed, repeat index)`` of the runs at one grid point: each seed s gives s, s+1, ...,
    s+repeats-1 (index None: the seed tells them apart), or with ``same_seed`` s ``repeats``
    times (index 0..repeats-1). Raises ValueError when two seeds' ranges overlap."""
    if same_seed:
        return [(s, r) for s in seeds for r in range(repeats)]
    out = [s + r for s in seeds for r in range(repeats)]
    twice = sorted({s for s in out if out.count(s) > 1})
    if twice:
        raise ValueError(
            f"--seeds {' '.join(map(str, seeds))} with --repeats {repeats} give seed(s) {twice} "
            f"more than once; space the seeds at least {repeats} apart, or use --same_seed"
        )
    return [(s, None) for s in out]


def grid(args) -> list[tuple[str, list[str]]]:
    """``(label, stress_8k.py arguments)`` per run: every lr x arm x qk-ln x seed (x repeat)."""
    jobs = []
    seeds = run_seeds(args.seeds, args.repeats, args.same_seed)
    for lr, arm, qk, (seed, rep) in itertools.product(args.lr, args.arms, args.qk_ln, seeds):
        tag = f"lr{lr:g}_qk{int(qk == 'True')}_s{seed}" + ("" if rep is None else f"_r{rep}")
        jobs.append(
            (
                f"{tag}/{arm}",
                [
                    "--preset",
                    args.preset,
                    "--arm",
                    arm,
                    f"--name={args.name}__{tag}",
                    f"--out_dir={args.out_dir}",
                    f"--train.lr={lr}",
                    f"--model.qk_layernorm={qk}",
                    f"--train.seed={seed}",
                    "--report=False",
                    *args.extra,
                ],
            )
        )
    return jobs


def run_one(job, log_dir: Path) -> tuple[str, int, float]:
    label, argv = job
    t0 = time.time()
    log = log_dir / (label.replace("/", "__") + ".log")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
    with open(log, "w") as f:
        rc = subprocess.call(
            [sys.executable, str(ROOT / "experiments" / "stress_8k.py"), *argv],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return label, rc, time.time() - t0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--name", required=True)
    ap.add_argument("--preset", default="proxy")
    ap.add_argument("--out_dir", default="runs")
    ap.add_argument("--lr", type=float, nargs="+", required=True)
    ap.add_argument(
        "--arms", nargs="+", default=["softmax", "sigmoid"], choices=["softmax", "sigmoid"]
    )
    ap.add_argument("--qk-ln", nargs="+", default=["False"], choices=["False", "True"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[42])
    ap.add_argument(
        "--repeats", type=positive_int, default=1, metavar="K",
        help="runs per grid point and seed: seeds s, s+1, ..., s+K-1 (default 1)",
    )  # fmt: skip
    ap.add_argument(
        "--same_seed", action="store_true",
        help="K runs of each seed itself (a nondeterministic backend, e.g. SDPA's backward)",
    )  # fmt: skip
    ap.add_argument("--parallel", type=positive_int, default=8)
    ap.add_argument("--dry_run", action="store_true", help="print the runs and exit")
    ap.add_argument("extra", nargs="*", help="overrides passed to every run (after --)")
    args = ap.parse_args(argv)
    if args.same_seed and args.repeats < 2:
        ap.error("--same_seed needs --repeats K with K >= 2")
    try:
        run_seeds(args.seeds, args.repeats, args.same_seed)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = grid(args)
    if args.dry_run:
        for label, argv_run in jobs:
            print(f"{label:40s} {' '.join(argv_run)}")
        return 0
    log_dir = Path(args.out_dir) / f"{args.name}__logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(jobs)} runs, {args.parallel} at a time")
    failed = 0
    with ThreadPoolExecutor(args.parallel) as pool:
        for label, rc, dt in pool.map(lambda j: run_one(j, log_dir), jobs):
            failed += rc != 0
            print(f"{label:40s} rc={rc} {dt:6.1f}s", flush=True)
    dirs = sorted(str(p.parent) for p in Path(args.out_dir).glob(f"{args.name}__*/*/config.json"))
    from stabilitylab.analysis.sweep import main as sweep_main

    sweep_main([*dirs, "--out", str(Path(args.out_dir) / f"{args.name}__report")])
    if args.repeats > 1:
        from stabilitylab.analysis.report import main as report_main

        report_main([*dirs, "--out", str(Path(args.out_dir) / f"{args.name}__rates")])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
