"""Cost of the live Jacobian probe against a training step, on this machine.

    python experiments/probes/live_cost.py --preset smoke
    python experiments/probes/live_cost.py --preset proxy --batch 8 --length 1024

Times one ``JacobianProbe.measure`` and one training step (forward + backward + AdamW) on the same
random batch, per attention arm, and prints the amortised overhead ``probe / (every * step)`` for a
few cadences. Batches smaller than the preset's make the ratio an upper bound: the step grows with
the batch, the probe (``samples`` sequences of ``tokens`` positions) does not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd
import torch

from stabilitylab.config import PRESETS
from stabilitylab.model import Transformer, masked_lm_loss_sum, vocab_size_for
from stabilitylab.probes.live import JacobianProbe


def random_batch(batch: int, length: int, vocab: int, gen: torch.Generator):
    """Full-length sequences (the costliest case for the step) with 15% of tokens as targets."""
    tokens_BT = torch.randint(3, vocab, (batch, length), generator=gen)
    lengths_B = torch.full((batch,), length, dtype=torch.long)
    labels_BT = torch.where(torch.rand(batch, length, generator=gen) < 0.15, tokens_BT, -100)
    return tokens_BT, lengths_B, labels_BT


def interleaved_medians(fns: list, repeats: int) -> list[tuple[float, float]]:
    """Median (wall, process CPU) seconds of each function, calls interleaved.

    Interleaving spreads load from other processes over all functions alike; CPU time (all
    threads of this process) is the steadier number on a shared machine.
    """
    for fn in fns:
        fn()  # warm-up: allocator, kernel selection, torch.func set-up
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append(time.perf_counter() - w0)
            cpu[i].append(time.process_time() - c0)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu, strict=True)]


def training_step(model, tokens_BT, lengths_B, labels_BT):
    """One optimizer step as the trainer takes it: forward, mean masked loss, backward, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        loss = masked_lm_loss_sum(model(tokens_BT, lengths_B), labels_BT)
        (loss / (labels_BT != -100).sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def cost_table(
    preset: str, batch: int | None, length: int | None, probe: JacobianProbe, repeats: int
):
    cfg = PRESETS[preset]()
    batch = batch or cfg.train.micro_batch
    length = length or cfg.data.context_len
    vocab = vocab_size_for(cfg.data.n_genes)
    gen = torch.Generator().manual_seed(0)
    tokens_BT, lengths_B, labels_BT = random_batch(batch, length, vocab, gen)
    rows = []
    for arm in ("softmax", "sigmoid"):
        torch.manual_seed(0)
        model = Transformer(
            cfg.model, vocab, cfg.data.context_len, cfg.backend_for(arm, cuda=False)
        )
        (step_s, step_cpu_s), (probe_s, probe_cpu_s) = interleaved_medians(
            [training_step(model, tokens_BT, lengths_B, labels_BT),
             lambda model=model: probe.measure(model, tokens_BT, lengths_B)],
            repeats,
        )  # fmt: skip
        rows.append(
            dict(preset=preset, arm=arm, batch=batch, length=length, step_s=step_s,
                 probe_s=probe_s, step_cpu_s=step_cpu_s, probe_cpu_s=probe_cpu_s,
                 probe_over_step=probe_s / step_s, probe_over_step_cpu=probe_cpu_s / step_cpu_s)
        )  # fmt: skip
    return pd.DataFrame(rows)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="smoke", choices=sorted(PRESETS))
    p.add_argument(
        "--batch", type=int, default=None, help="sequences per step (default: preset micro_batch)"
    )
    p.add_argument(
        "--length", type=int, default=None, help="tokens per sequence (default: preset context_len)"
    )
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--every", type=int, nargs="+", default=[50, 100, 200, 500])
    args = p.parse_args()
    probe = JacobianProbe(every=1, samples=args.samples, tokens=args.tokens, iters=args.iters)
    df = cost_table(args.preset, args.batch, args.length, probe, args.repeats)
    for every in args.every:
        # amortised: one probe per `every` steps, the worse of the wall and CPU ratios
        df[f"overhead@{every}"] = df[["probe_over_step", "probe_over_step_cpu"]].max(axis=1) / every
    with pd.option_context("display.width", 200, "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False))


if __name__ == "__main__":
    main()
