"""Benchmark the lab's model at the stress setting on one GPU: step time, tokens/s, MFU, peak
memory per arm, and the cost of the default telemetry.

    python experiments/bench/bench_model.py                   # 160M, T=8192, micro-batch 1
    python experiments/bench/bench_model.py --arms softmax sigmoid-triton --steps 10
    python experiments/bench/bench_model.py --variants eager compile mb8 chunked-ce no-copies \
        pad-vocab all det det-all

Variants (stabilitylab/train/levers.py): ``eager`` (today's step), each speed lever alone
(``compile``, ``mb8``, ``chunked-ce``, ``no-copies``, ``pad-vocab``, ``accum``), ``all`` of them,
the alternatives (``mb2``, ``mb4``, ``compile-blocks``, ``compile-cg``, ``autotune``, ``coord``),
levers joined by ``+`` (``compile+mb2+pad-vocab``, ``all+autotune``), and the deterministic
``det`` (eager) and ``det-all`` (all levers): the step under
``torch.use_deterministic_algorithms(True)`` for that row's steps only, as train.deterministic
runs it, with its backend (softmax -> softmax-triton, sigmoid-triton with its pinned configs).
One row per arm x variant, labelled by the backend that ran (``softmax-triton / det``).
``first_step_s``: building and the first step (autotuning, compiling).

Columns ``mfu`` and ``mfu_labelled``: model FLOPs per second over the dense bf16 peak.
``mfu`` counts the FLOPs of the eager step, the head's GEMMs on every position
(``model.flops_per_step``: 6 x dense params x tokens + attention); ``mfu_labelled`` counts the
head on the labelled positions only (15% of them; ``model.flops_per_step_labelled``), the work
the masked-token loss needs. A variant that skips the head on unlabelled rows (``chunked-ce``,
``all``) does not do the FLOPs ``mfu`` credits it with, so ``mfu`` overstates it; compare such
rows by ``mfu_labelled`` (or by step time). Padded rows (``pad-vocab``) are never counted.

One optimizer step = forward + backward + AdamW on one micro-batch of full-length sequences
(bf16 autocast), or on ``ACCUM_MICRO_BATCHES`` of them with ``accum``; ``B`` counts the sequences
of a step, ``ms_per_seq`` is the step over ``B``. Telemetry overhead: the extra time of a step that records max |logit| and of one
that measures per-layer norms, amortised over the default cadences (every 50 steps), plus the
global grad norm taken every step; target <= 3% of step time. Results go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stabilitylab.config import stress_8k
from stabilitylab.model import (
    count_parameters,
    dense_parameter_count,
    flops_per_step,
    flops_per_step_labelled,
    head_parameter_count,
)
from stabilitylab.train.levers import (
    VARIANTS,
    StepRig,
    build_rig,
    cli_variants,
)

KINDS = {
    "bare": {"grad_norm": False},
    "gn": {},
    "logit": {"record_logits": True},
    "layer": {"layer_stats": True},
}


def timed_once(rig: StepRig, **kw) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rig.step(**kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prepare(cfg, arm: str, variant: str, micro_batch: int, kinds: dict) -> dict:
    """Build one arm x variant, warm it up (each telemetry kind, so a compiled model has traced
    every graph it needs) and measure its peak memory on a plain step, net of what the models
    built before it hold."""
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    rig = build_rig(cfg, arm, variant, "cuda", micro_batch)
    rig.step(**({"record_logits": True, "layer_stats": True} if "logit" in kinds else {}))
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(2):
        for kw in kinds.values():
            rig.step(**kw)
    torch.cuda.reset_peak_memory_stats()
    timed_once(rig, grad_norm=False)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {"rig": rig, "first_s": first_s, "peak_mem_GiB": peak, "times": {k: [] for k in kinds}}


def summarise(cfg, entry: dict, peak_tflops: float, every: int = 50) -> dict:
    """The row of one arm x variant from its interleaved timings (medians)."""
    rig, times = entry["rig"], entry["times"]
    med = {k: statistics.median(v) for k, v in times.items()}
    t_bare = med["bare"]
    B, T = rig.batch[0].shape
    B *= rig.micro_batches  # sequences per optimizer step
    n_dense = dense_parameter_count(rig.model)
    flops = flops_per_step(cfg.model, n_dense, [T] * B)
    n_labelled = rig.n_labelled * rig.micro_batches
    n_head = head_parameter_count(rig.model)
    flops_labelled = flops_per_step_labelled(cfg.model, n_dense, n_head, [T] * B, n_labelled)
    row = {
        "arm / variant": rig.label,
        "params_M": count_parameters(rig.model) / 1e6,
        "B": B,
        "T": T,
        "step_ms": t_bare * 1e3,
        "ms_per_seq": t_bare * 1e3 / B,
        "tokens_per_s": B * T / t_bare,
        "mfu": flops / t_bare / (peak_tflops * 1e12),
        "mfu_labelled": flops_labelled / t_bare / (peak_tflops * 1e12),
        "peak_mem_GiB": entry["peak_mem_GiB"],
        "first_step_s": entry["first_s"],
    }
    if "logit" in med:
        t_gn = med["gn"]
        overhead = (t_gn - t_bare) + (med["logit"] - t_gn) / every + (med["layer"] - t_gn) / every
        row |= {
            "logit_step_ms": med["logit"] * 1e3,
            "layer_step_ms": med["layer"] * 1e3,
            "telemetry_overhead_pct": 100 * overhead / t_bare,
        }
    return row


def bench(cfg, arms, variants, micro_batch, steps, peak_tflops, telemetry=True):
    """Every arm x variant built and warmed up, then timed in interleaved rounds: each round
    steps every one of them once per telemetry kind, so drift (clocks, allocator, neighbours)
    hits them alike. Returns ``(rows, entries, skipped)``: a variant that fails to build or warm
    up (a compile error, out of memory) is skipped, named, and the others still run."""
    kinds = KINDS if telemetry else {"bare": KINDS["bare"]}
    entries, skipped = [], []
    for a in arms:
        for v in variants:
            try:
                entries.append(prepare(cfg, a, v, micro_batch, kinds))
            except Exception as e:  # one failing variant (a compile error, OOM) spares the rest
                print(f"SKIPPED {a} / {v}: {type(e).__name__}: {str(e)[:500]}", flush=True)
                skipped.append(f"{a} / {v}")
                torch.cuda.empty_cache()
    if not entries:
        raise SystemExit("error: no arm x variant could be built and warmed up")
    for _ in range(steps):
        for e in entries:
            for k, kw in kinds.items():
                e["times"][k].append(timed_once(e["rig"], **kw))
    return [summarise(cfg, e, peak_tflops) for e in entries], entries, skipped


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", nargs="+", default=["softmax", "sigmoid-triton"])
    ap.add_argument("--variants", nargs="+", default=["eager"], help=f"any of {list(VARIANTS)}")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument(
        "--no-telemetry", action="store_true", help="time the plain step only (no overhead)"
    )
    ap.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200: 989)"
    )
    args = ap.parse_args()
    variants = cli_variants(args.variants, "bench_model.py")
    cfg = stress_8k()
    cfg.data.context_len = args.context
    rows, entries, skipped = bench(
        cfg, args.arms, variants, args.micro_batch, args.steps, args.peak_tflops,
        telemetry=not args.no_telemetry,
    )  # fmt: skip
    print(
        f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | "
        f"triton {__import__('triton').__version__} | CUDA {torch.version.cuda}"
    )
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print(
            "| "
            + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values())
            + " |"
        )
    for e in entries:
        if e["rig"].compile_note:
            print(f"compile {e['rig'].label}: {e['rig'].compile_note}")
    if skipped:
        raise SystemExit(f"error: skipped (see above): {skipped}")


if __name__ == "__main__":
    main()
