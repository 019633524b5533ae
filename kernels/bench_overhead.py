"""Host overhead of the sigmoid-attention op against direct launches of its forward, on one GPU.

    PYTHONPATH=. python3 kernels/bench_overhead.py

Per shape (the benchmark's batches: 16,384 tokens, hidden 2048): do_bench median of the op with and
without autograd inputs and of ``launch_forward`` with each lever set, then host time per call
(200 calls queued without a sync). When a kernel is shorter than the host work in front of it, the
timed figure is host time, not kernel time (docs/BENCHMARKS.md, "Host overhead").
"""

from __future__ import annotations

import math
import time

import torch
import triton

from stabilitylab.kernels import sigmoid_attention
from stabilitylab.kernels.bench_attention import make_inputs
from stabilitylab.kernels.sigmoid_attention import TANH_F32, launch_forward

SHAPES = [
    (64, 1024, 0.0), (64, 4096, 0.5), (128, 4096, 0.5), (128, 1024, 0.0), (128, 8192, 0.0),
    (64, 16384, 0.0),
]  # fmt: skip


def host_us(fn, n: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


NAMES = ["op", "op-nograd", "tma+la", "ptr+la", "tma", "plain"]


def measure(D: int, T: int, pad: float) -> tuple[dict, dict]:
    """(do_bench ms per name, host us per call for four of them) at one shape."""
    q, k, v, L = make_inputs(T, D, pad)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    args = (L, 1 / math.sqrt(D), 0.0, True, TANH_F32, False)

    def direct(tma: bool, la: bool):
        return lambda: launch_forward(qd, kd, vd, *args, tma=tma, lookahead=la)

    fns = {
        "op": lambda: sigmoid_attention(q, k, v, L)[0],
        "op-nograd": lambda: sigmoid_attention(qd, kd, vd, L)[0],
        "tma+la": direct(True, True),
        "ptr+la": direct(False, True),
        "tma": direct(True, False),
        "plain": direct(False, False),
    }
    ms = {n: triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median")
          for n, f in fns.items()}  # fmt: skip
    us = {n: host_us(fns[n]) for n in ("op", "op-nograd", "tma+la", "plain")}
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
