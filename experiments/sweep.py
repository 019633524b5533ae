"""Run a grid of single-arm runs side by side on one GPU (small models leave an H200 mostly idle),
then summarise them with analysis/sweep.py.

    PYTHONPATH=. python3 experiments/sweep.py --name lr_sweep --preset proxy \
        --lr 1e-4 3e-4 1e-3 3e-3 1e-2 --arms softmax sigmoid --qk-ln False True --seeds 1 2 \
        --parallel 16 -- --train.steps=1000

Each run is `experiments/stress_8k.py --arm A --name <name>/<tag>` with its overrides, so every run
is an ordinary run directory (config, provenance, events, summary.json) under runs/<name>/.
Expected (Wortsman et al. 2023): without QK-LayerNorm the final loss rises at high lr; with it the
curve is flatter. Whether sigmoid behaves like softmax here is what the sweep measures.
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


def grid(args) -> list[tuple[str, list[str]]]:
    jobs = []
    for lr, arm, qk, seed in itertools.product(args.lr, args.arms, args.qk_ln, args.seeds):
        tag = f"lr{lr:g}_qk{int(qk == 'True')}_s{seed}"
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


def main() -> int:
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
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("extra", nargs="*", help="overrides passed to every run (after --)")
    args = ap.parse_args()
    jobs = grid(args)
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
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
