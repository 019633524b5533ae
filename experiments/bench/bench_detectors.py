"""Time of each divergence detector on a long series (what the report and the online policy pay).

    python experiments/bench/bench_detectors.py                 # 1e5 points, best of 5
    python experiments/bench/bench_detectors.py --points 1000000 --repeats 3

Prints the best wall time per detector. On 2 shared CPU cores at 1e5 points: 0.1-7 ms per
detector, ~10 ms for ``diverged``. A busy machine can be several times slower, which is why speed
is measured here and not asserted in a test.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from stabilitylab.analysis import detectors as det


def series(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(steps, loss, grad norm)``: a decaying loss, then a slow grad-norm blow-up at 60%."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n) * 10
    loss = 6.0 * np.exp(-np.arange(n) / (n / 20)) + 2 + 0.05 * rng.standard_normal(n)
    gn = np.exp(0.3 * rng.standard_normal(n))
    at = int(0.6 * n)
    gn[at:] *= np.exp(np.arange(n - at) / 500)  # many candidate points for the rules
    loss[at + n // 200 :] = 9.0
    return steps, loss, gn


def best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--points", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    steps, loss, gn = series(args.points)
    calls = {name: (lambda fn=fn: fn(steps, gn)) for name, fn in det.DETECTORS.items()}
    calls["loss_divergence"] = lambda: det.loss_divergence(steps, loss)
    calls["diverged"] = lambda: det.diverged(steps, loss, steps, gn)
    print(f"{args.points} points, best of {args.repeats}")
    for name, call in calls.items():
        print(f"{name:24s} {best_time(call, args.repeats) * 1e3:8.2f} ms")
    hit = det.diverged(steps, loss, steps, gn)
    print(f"diverged at step {hit.step if hit else None}")


if __name__ == "__main__":
    main()
