"""SM clock and board power while the GPU runs the 160M@8K step, and the attention kernels alone.

    python experiments/bench/bench_clocks.py                          # eager, all, attention
    python experiments/bench/bench_clocks.py --variants all --seconds 20

Why: the same attention kernel takes longer per sequence inside the dense compiled step than in
the eager step, whose GPU idles between kernels. Under a board power limit the clock is what
gives. Each workload is warmed up, then repeated for ``--seconds`` while ``nvidia-smi`` samples
the SM clock and power draw every ``--every-ms``; one row per workload: the median step (or
attention call) per sequence, the median SM clock and power over the window, and the power
limit. Workloads: ``attention B=..`` (the sigmoid-triton forward + backward alone, once per
block, on B x heads x T x head dim bf16 inputs (12 x 8192 x 64 at stress_8k): the step's attention work per micro-batch, so
its ms per sequence compares with the profile's attention rows) for each ``--attention-batch``,
and each variant of ``stabilitylab.train.levers`` (as ``bench_model.py`` steps it, without
telemetry). Results go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import threading
import time

import pandas as pd
import torch

from stabilitylab.analysis.markdown import table as markdown_table
from stabilitylab.config import stress_8k
from stabilitylab.kernels.sigmoid_attention import sigmoid_attention
from stabilitylab.train.levers import VARIANTS, build_rig, cli_variants

QUERY = "clocks.sm,power.draw,power.limit"


def parse_sample(line: str) -> tuple[float, float, float] | None:
    """``(SM clock MHz, power W, power limit W)`` of one ``nvidia-smi`` line of ``QUERY``, or None
    for a line it cannot read (``[N/A]``, a partial line)."""
    parts = line.split(",")
    if len(parts) != 3:
        return None
    try:
        clock, power, limit = (float(x) for x in parts)
    except ValueError:
        return None
    return clock, power, limit


class SmiSampler:
    """``nvidia-smi`` sampling ``QUERY`` every ``every_ms`` in a thread; ``window()`` gives the
    samples taken since ``mark()``."""

    def __init__(self, every_ms: int, device: int = 0):
        cmd = [
            "nvidia-smi", f"--id={device}", f"--query-gpu={QUERY}",
            "--format=csv,noheader,nounits", f"-lms={every_ms}",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.samples: list[tuple[float, float, float, float]] = []
        self._start = 0.0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                self.samples.append((time.monotonic(), *sample))

    def mark(self) -> None:
        self._start = time.monotonic()

    def window(self) -> list[tuple[float, float, float, float]]:
        return [s for s in self.samples if s[0] >= self._start]

    def close(self) -> None:
        self.proc.terminate()


def attention_call(B: int, T: int, layers: int, H: int, D: int):
    """``layers`` forwards + backwards of sigmoid-triton on (B, H, T, D) bf16 inputs, full
    lengths: the attention work of one step of a ``layers``-block model on B sequences."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
        for _ in range(3)
    )
    lengths = torch.full((B,), T, device="cuda", dtype=torch.long)
    d_out = torch.randn_like(q)

    def call() -> None:
        for _ in range(layers):
            out, _ = sigmoid_attention(q, k, v, lengths)
            torch.autograd.grad(out, (q, k, v), d_out)

    return call


def run_window(call, sampler: SmiSampler, seconds: float) -> tuple[list[float], list]:
    """Repeat ``call`` (each between two synchronisations) for ``seconds``: its times, samples."""
    torch.cuda.synchronize()
    sampler.mark()
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, sampler.window()


def row(name: str, seqs: int, times: list[float], samples: list) -> dict:
    if not samples:
        raise RuntimeError(f"{name}: nvidia-smi gave no samples in the window")
    _, clocks, powers, limits = zip(*samples, strict=True)
    return {
        "workload": name,
        "sequences": seqs,
        "calls": len(times),
        "ms_per_seq": statistics.median(times) * 1e3 / seqs,
        "sm_clock_MHz": statistics.median(clocks),
        "sm_clock_min_MHz": min(clocks),
        "power_W": statistics.median(powers),
        "power_limit_W": statistics.median(limits),
        "samples": len(samples),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arm", default="sigmoid-triton")
    ap.add_argument("--variants", nargs="+", default=["eager", "all"],
                    help=f"any of {list(VARIANTS)}")  # fmt: skip
    ap.add_argument("--attention-batch", type=int, nargs="+", default=[1, 4],
                    help="B of each attention workload")  # fmt: skip
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--every-ms", type=int, default=50)
    args = ap.parse_args()
    variants = cli_variants(args.variants, "bench_clocks.py")
    cfg = stress_8k()
    T = cfg.data.context_len
    sampler = SmiSampler(args.every_ms)
    rows = []
    try:
        for B in args.attention_batch:
            m = cfg.model
            call = attention_call(B, T, m.n_layers, m.n_heads, m.head_dim)
            for _ in range(3):
                call()
            rows.append(row(f"attention B={B}", B, *run_window(call, sampler, args.seconds)))
        for v in variants:
            rig = build_rig(cfg, args.arm, v, "cuda")
            for _ in range(3):
                rig.step(grad_norm=False)
            seqs = rig.batch[0].shape[0] * rig.micro_batches
            rows.append(row(f"{args.arm} / {v}", seqs,
                            *run_window(lambda r=rig: r.step(grad_norm=False), sampler,
                                        args.seconds)))  # fmt: skip
            del rig
            torch.cuda.empty_cache()
    finally:
        sampler.close()
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"triton {__import__('triton').__version__}")  # fmt: skip
    print(markdown_table(pd.DataFrame(rows)))


if __name__ == "__main__":
    main()
