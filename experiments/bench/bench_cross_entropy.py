"""The chunked loss's per-chunk work on the GPU: the Triton kernel (``kernels/cross_entropy.py``)
against the same function in torch ops (``cross_entropy_grad_reference``, the path off CUDA).

    python experiments/bench/bench_cross_entropy.py                 # one 160M@8K chunk
    python experiments/bench/bench_cross_entropy.py --rows 1024 --vocab 50257

One chunk as ``stabilitylab.chunked_loss`` makes it at stress_8k: 2^27 logits over the head's
44,003 rows padded to 44,032 (3,048 rows), bf16 logits. Prints the largest differences of the
loss and the gradient, and ``do_bench`` medians with the bandwidth at the kernel's 6 bytes per
logit (two reads, one write). Results go to docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import importlib

import torch
import triton

from stabilitylab.chunked_loss import MAX_CHUNK_ELEMENTS, rows_per_chunk
from stabilitylab.model import HEAD_ROW_MULTIPLE, padded_size

ce = importlib.import_module("stabilitylab.kernels.cross_entropy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=44003)
    ap.add_argument("--row-multiple", type=int, default=HEAD_ROW_MULTIPLE)
    ap.add_argument("--rows", type=int, default=None, help="default: one chunk of the loss's")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cross_entropy.py needs CUDA")
    V = args.vocab
    P = padded_size(V, args.row_multiple)
    R = args.rows or rows_per_chunk(P, MAX_CHUNK_ELEMENTS)
    gen = torch.Generator("cuda").manual_seed(0)
    x_RP = (torch.randn(R, P, device="cuda", generator=gen) * 3).bfloat16()
    y_R = torch.randint(0, V, (R,), device="cuda", generator=gen)
    kernel = lambda: ce.cross_entropy_grad(x_RP, y_R, V)  # noqa: E731
    torch_ops = lambda: ce.cross_entropy_grad_reference(x_RP, y_R, V)  # noqa: E731
    (loss_k, g_k), (loss_t, g_t) = kernel(), torch_ops()
    print(f"{R} x {P} logits (V = {V}), bf16")
    print(
        f"max |loss diff| {(loss_k - loss_t).abs().max().item():.2e}, "
        f"max |grad diff| {(g_k.float() - g_t.float()).abs().max().item():.2e}"
    )
    for name, fn in (("torch ops", torch_ops), ("kernel", kernel)):
        ms = triton.testing.do_bench(fn, warmup=20, rep=200)
        print(f"{name}: {ms:.3f} ms per chunk ({R * P * 6 / ms / 1e9:.2f} TB/s at 6 B per logit)")


if __name__ == "__main__":
    main()
