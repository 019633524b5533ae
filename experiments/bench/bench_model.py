"""Benchmark the lab's model at the stress setting on one GPU: step time, tokens/s, MFU, peak
memory per arm, and the cost of the default telemetry.

    python experiments/bench/bench_model.py                   # 160M, T=8192, micro-batch 1
    python experiments/bench/bench_model.py --arms softmax sigmoid-triton --steps 10

One optimizer step = forward + backward + AdamW on one micro-batch of full-length sequences
(bf16 autocast). Telemetry overhead: the extra time of a step that records max |logit| and of one
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
    Transformer,
    count_parameters,
    dense_parameter_count,
    flops_per_step,
    masked_lm_loss_sum,
    vocab_size_for,
)
from stabilitylab.telemetry import LayerStatsMonitor, LogitMonitor, global_grad_norm
from stabilitylab.train import make_optimizer


def _batch(B: int, T: int, vocab: int, device):
    g = torch.Generator().manual_seed(0)
    tokens_BT = torch.randint(3, vocab, (B, T), generator=g).to(device)
    labels_BT = torch.where(torch.rand(B, T, generator=g) < 0.15, tokens_BT.cpu(), -100).to(device)
    lengths_B = torch.full((B,), T, dtype=torch.long, device=device)
    return tokens_BT, lengths_B, labels_BT


def bench_arm(cfg, backend: str, B: int, steps: int, peak_tflops: float) -> dict:
    device = torch.device("cuda")
    T = cfg.data.context_len
    vocab = vocab_size_for(cfg.data.n_genes)
    torch.manual_seed(0)
    model = Transformer(cfg.model, vocab, T, backend).to(device)
    opt = make_optimizer(cfg, model)
    params = list(model.parameters())
    n_params = count_parameters(model)
    n_dense = dense_parameter_count(model)
    tokens_BT, lengths_B, labels_BT = _batch(B, T, vocab, device)
    logit_mon, layer_mon = LogitMonitor(1), LayerStatsMonitor(1)

    def step(record_logits=False, layer_stats=False, grad_norm=True):
        """One optimizer step as the trainer takes it (stabilitylab.train.step), telemetry chosen."""
        if record_logits:
            logit_mon.attach(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens_BT, lengths_B)
        loss = masked_lm_loss_sum(logits, labels_BT) / (labels_BT != -100).sum()
        loss.backward()
        if record_logits:
            logit_mon.collect(model)
        if grad_norm:
            loss_gn = torch.stack([loss.detach().float(), global_grad_norm(params)])
            opt.found_inf = (~torch.isfinite(loss_gn).all()).float()
        else:
            opt.found_inf = None
        if layer_stats:
            layer_mon.before_step(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if grad_norm:
            loss_gn.tolist()  # the trainer's one host read per step, after the update is queued
        if record_logits:
            logit_mon.detach(model).tolist()
        if layer_stats:
            layer_mon.after_step(model).tolist()

    def timed_once(**kw) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(**kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        step(record_logits=True, layer_stats=True)
    torch.cuda.reset_peak_memory_stats()
    timed_once(grad_norm=False)
    peak_mem = torch.cuda.max_memory_allocated() / 2**30  # a plain training step
    # Interleaved, so drift (clocks, allocator, other tenants) hits every variant alike.
    kinds = {
        "bare": {"grad_norm": False},
        "gn": {},
        "logit": {"record_logits": True},
        "layer": {"layer_stats": True},
    }
    times = {k: [] for k in kinds}
    for _ in range(steps):
        for k, kw in kinds.items():
            times[k].append(timed_once(**kw))
    t_bare, t_gn, t_logit, t_layer = (statistics.median(times[k]) for k in kinds)
    every = 50
    overhead = (t_gn - t_bare) + (t_logit - t_gn) / every + (t_layer - t_gn) / every
    flops = flops_per_step(cfg.model, n_dense, [T] * B)
    return {
        "backend": backend,
        "params_M": n_params / 1e6,
        "B": B,
        "T": T,
        "step_ms": t_bare * 1e3,
        "tokens_per_s": B * T / t_bare,
        "mfu": flops / t_bare / (peak_tflops * 1e12),
        "peak_mem_GiB": peak_mem,
        "logit_step_ms": t_logit * 1e3,
        "layer_step_ms": t_layer * 1e3,
        "telemetry_overhead_pct": 100 * overhead / t_bare,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arms", nargs="+", default=["softmax", "sigmoid-triton"])
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200: 989)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_model.py needs a CUDA GPU")
    cfg = stress_8k()
    cfg.data.context_len = args.context
    rows = [bench_arm(cfg, a, args.micro_batch, args.steps, args.peak_tflops) for a in args.arms]
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


if __name__ == "__main__":
    main()
