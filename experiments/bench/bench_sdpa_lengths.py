"""SDPA at jagged lengths: what a sequence length the process has not seen costs each backend.

    python experiments/bench/bench_sdpa_lengths.py

The stress_8k trainer feeds one cell per micro-batch, each as long as its cell (770-8192 tokens),
so nearly every micro-batch of a short run has a length the process has not met before. Two
measurements, bf16, B = 1, H = 12, D = 64 (the 160M encoder's attention), forward + backward of
one ``scaled_dot_product_attention`` call, wall time with a sync on each side:

1. per backend (flash, cuDNN, memory-efficient): 8 lengths once each ("new length"), then the
   same 8 again;
2. cuDNN only: 300 consecutive new lengths (1000-1299), then the first 10 again: whether a
   length's cost stays paid (its execution plan kept) after hundreds of others.

Results go to docs/BENCHMARKS.md ("Training step at 8K, jagged lengths").
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, D = 12, 64
LENGTHS = [770, 4321, 8192, 5003, 2999, 7777, 1234, 6543]
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)


def fwd_bwd_ms(T: int, backend: SDPBackend) -> float:
    """Wall ms of one forward + backward at length T through ``backend`` alone."""
    q, k, v = (
        torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with sdpa_kernel([backend]):
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("error: bench_sdpa_lengths.py needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__}")
    print(f"lengths: {LENGTHS}")
    for backend in BACKENDS:
        fwd_bwd_ms(512, backend)  # the backend's first call, at a length not in LENGTHS
        first = [fwd_bwd_ms(T, backend) for T in LENGTHS]
        again = [fwd_bwd_ms(T, backend) for T in LENGTHS]
        print(
            f"{backend.name:22s} new length ms: " + " ".join(f"{t:.1f}" for t in first)
            + " | again: " + " ".join(f"{t:.2f}" for t in again), flush=True,
        )  # fmt: skip
    first = [fwd_bwd_ms(T, SDPBackend.CUDNN_ATTENTION) for T in range(1000, 1300)]
    again = [fwd_bwd_ms(T, SDPBackend.CUDNN_ATTENTION) for T in range(1000, 1010)]
    print(
        f"cuDNN, 300 new lengths: median ms {sorted(first)[150]:.1f}; the first 10 again: "
        + " ".join(f"{t:.2f}" for t in again)
    )


if __name__ == "__main__":
    main()
