"""Host overhead of the sigmoid-attention op against direct launches of its forward, on one GPU.

    python experiments/bench/bench_overhead.py

Prints, per shape (the benchmark's batches: 16,384 tokens, hidden 2048), the do_bench median (ms)
of the op with and without autograd inputs and of its launcher called directly (``forward_auto``:
no custom op, no autograd), then the host time per call (us; 200 calls queued without a sync).
When a kernel is shorter than the host work in front of it, the timed figure is host time, not
kernel time (docs/BENCHMARKS.md, "Host overhead").
"""

from __future__ import annotations

import importlib
import math
import time

import torch
import triton
from bench_attention import make_inputs  # the script beside this one (its folder is on sys.path)

from stabilitylab.kernels import sigmoid_attention

sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")  # the module, not the op

SHAPES = [
    (64, 1024, 0.0), (64, 4096, 0.5), (128, 4096, 0.5), (128, 1024, 0.0), (128, 8192, 0.0),
    (64, 16384, 0.0),
]  # fmt: skip
NAMES = ["op", "op-nograd", "launcher"]


def host_us(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def measure(D: int, T: int, pad: float) -> tuple[dict, dict]:
    """(do_bench ms per name, host us per call per name) at one shape."""
    q, k, v, L = make_inputs(T, D, pad)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    args = (L, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32, False)
    fns = {
        "op": lambda: sigmoid_attention(q, k, v, L)[0],
        "op-nograd": lambda: sigmoid_attention(qd, kd, vd, L)[0],
        "launcher": lambda: sa.forward_auto(qd, kd, vd, *args)[0],
    }
    ms = {n: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
          for n, f in fns.items()}  # fmt: skip
    us = {n: host_us(f) for n, f in fns.items()}
    return ms, us


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_overhead needs a CUDA GPU")
    print(f"{'D':>4} {'T':>6} {'pad':>5} | " + " ".join(f"{n:>9}" for n in NAMES) + " ms | host us")
    for D, T, pad in SHAPES:
        ms, us = measure(D, T, pad)
        print(
            f"{D:>4} {T:>6} {pad:>5} | "
            + " ".join(f"{ms[n]:9.3f}" for n in NAMES)
            + " | "
            + " ".join(f"{n} {u:.0f}" for n, u in us.items()),
            flush=True,
        )


if __name__ == "__main__":
    main()
