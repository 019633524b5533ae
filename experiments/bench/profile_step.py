"""Where the training step's time goes, per arm: torch.profiler around a few warmed-up steps.

    python experiments/bench/profile_step.py --out results/profile         # 160M, T=8192, mb 1
    python experiments/bench/profile_step.py --variants eager all --out results/profile
    python experiments/bench/profile_step.py --device cpu --tiny --out /tmp/p   # smoke, seconds

The step is bench_model.py's (stabilitylab/train/levers.py: forward + loss + backward + grad norm +
fused AdamW, bf16 autocast on CUDA). Each arm x variant: warm-up steps, the median of a few plain
steps without the profiler, then ``--steps`` profiled steps, each between two synchronisations.
Kernels go to buckets (stabilitylab/analysis/step_profile.py); idle/host gap = profiled wall
time - summed kernel time. Writes, per arm x variant, ``<arm>__<variant>.md`` / ``.csv`` and a
Chrome trace ``.json`` (``--trace``), plus ``profile.md`` with every table; prints the tables.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from stabilitylab.analysis.step_profile import (
    StepProfile,
    kernels_from_profiler,
    summarise,
    to_csv,
    to_markdown,
)
from stabilitylab.config import stress_8k
from stabilitylab.presets import smoke
from stabilitylab.train.levers import (
    VARIANTS,
    StepRig,
    build_rig,
    cli_variants,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(rig: StepRig, n: int) -> list[float]:
    """Wall milliseconds of ``n`` plain steps (grad norm on, no per-layer telemetry), each
    between two synchronisations."""
    out = []
    for _ in range(n):
        _sync(rig.device)
        t0 = time.perf_counter()
        rig.step()
        _sync(rig.device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def profile_rig(rig: StepRig, warmup: int, steps: int, trace: Path | None) -> StepProfile:
    """Warm ``rig`` up, time it plainly, then profile ``steps`` steps and bucket their kernels."""
    timed_steps(rig, warmup)
    unprofiled = statistics.median(timed_steps(rig, steps))
    activities = [ProfilerActivity.CPU]
    if rig.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        walls = timed_steps(rig, steps)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    kernels = kernels_from_profiler(prof, rig.device.type)
    return summarise(kernels, sum(walls), steps, rig.label, unprofiled_ms=unprofiled)


def config(tiny: bool, context: int):
    """The stress preset at ``context`` (CUDA), or the smoke preset's tiny model (CPU smoke)."""
    if tiny:
        return smoke()
    cfg = stress_8k()
    cfg.data.context_len = context
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", nargs="+", default=["sigmoid-triton", "softmax"])
    ap.add_argument("--variants", nargs="+", default=["eager"], help=f"any of {list(VARIANTS)}")
    ap.add_argument("--out", type=Path, required=True, help="directory for the tables")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="the smoke preset's model (CPU smoke)")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per arm x variant")
    ap.add_argument("--trace", action="store_true", help="also write Chrome traces (large)")
    args = ap.parse_args()
    variants = cli_variants(args.variants, "profile_step.py", need_cuda=False)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda needs a CUDA GPU (or --device cpu --tiny)")
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(
            f"error: --steps must be >= 1, --warmup >= 0 (got {args.steps}, {args.warmup})"
        )
    cfg = config(args.tiny, args.context)
    args.out.mkdir(parents=True, exist_ok=True)
    tables, skipped = [], []
    for arm in args.arms:
        for variant in variants:
            stem = f"{arm}__{variant}"
            trace = args.out / f"{stem}.json" if args.trace else None
            try:
                rig = build_rig(cfg, arm, variant, args.device, args.micro_batch)
                p = profile_rig(rig, args.warmup, args.steps, trace)
            except Exception as e:  # one failing variant (a compile error, OOM) spares the rest
                print(f"SKIPPED {arm} / {variant}: {type(e).__name__}: {str(e)[:500]}", flush=True)
                skipped.append(stem)
                continue
            md = to_markdown(p) + (f"\ncompile: {rig.compile_note}\n" if rig.compile_note else "")
            (args.out / f"{stem}.md").write_text(md)
            (args.out / f"{stem}.csv").write_text(to_csv(p))
            tables.append(md)
            print(md, flush=True)
            del rig
    (args.out / "profile.md").write_text("\n".join(tables))
    if skipped:
        raise SystemExit(f"error: skipped (see above): {skipped}")


if __name__ == "__main__":
    main()
