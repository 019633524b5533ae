"""One optimizer step: forward/backward over the micro-batches, the update, the one host read.

The loss is the mean over every masked token of the global batch: each micro-batch's summed
cross-entropy is scaled by ``world / n_masked`` (DDP averages gradients over processes), so one
process and N processes at the same global batch follow the same curve.

Nothing in :func:`train_step` waits for the device. The update is skipped on the device when the
loss or a gradient is not finite (AdamW's ``found_inf``, as GradScaler uses it), so the host reads
the step's numbers once, in :func:`read_numbers`, after the update is queued.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from stabilitylab.data.loader import StepBatch
from stabilitylab.model import masked_lm_loss_sum
from stabilitylab.telemetry import StepTelemetry, global_grad_norm
from stabilitylab.train.build import Trainee


@dataclass
class StepOut:
    """What a step leaves on the device."""

    stats_3: torch.Tensor
    """float32 ``[loss, global grad norm (before clipping), valid tokens of all processes]``."""
    layer_stats_3L: torch.Tensor | None
    """Per-layer grad norm, parameter norm, update ratio (steps the layer monitor measures)."""
    max_LH: torch.Tensor | None
    """Max |attention logit| per layer and head over all processes (logit-monitor steps)."""


@dataclass
class StepNumbers:
    """The same numbers on the host."""

    loss: float
    grad_norm: float
    n_tokens: float
    layer_stats_3L: list[list[float]] | None
    max_LH: list[list[float]] | None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def _loss_and_backward(t: Trainee, data: StepBatch, n_masked: torch.Tensor, tel: StepTelemetry):
    """Summed masked-token loss of this process's micro-batches; gradients accumulated."""
    loss_sum = torch.zeros((), device=n_masked.device)
    for i, b in enumerate(data.micro):
        last = i == len(data.micro) - 1
        with contextlib.nullcontext() if last else t.accelerator.no_sync(t.model):
            logits_BTV = t.model(b.tokens_BT, b.lengths_B)
            part = masked_lm_loss_sum(logits_BTV, b.labels_BT)
            t.accelerator.backward(part * (t.world / n_masked))
        loss_sum += part.detach()
        if tel.logit.due(data.step):
            tel.logit.collect(t.raw)
    return loss_sum


def train_step(
    t: Trainee, data: StepBatch, lr: float, clip_grad: float | None, tel: StepTelemetry
) -> StepOut:
    """One update from ``data`` (already on the device); returns the step's device numbers."""
    counts_2 = data.counts_2
    if t.world > 1:
        counts_2 = t.accelerator.reduce(counts_2, reduction="sum")
    for g in t.optimizer.param_groups:
        g["lr"] = lr
    log_logits = tel.logit.due(data.step)
    if log_logits:
        tel.logit.attach(t.raw)
    loss_sum = _loss_and_backward(t, data, counts_2[0], tel)
    max_LH = tel.logit.detach(t.raw) if log_logits else None
    if max_LH is not None and t.world > 1:
        torch.distributed.all_reduce(max_LH, op=torch.distributed.ReduceOp.MAX)

    gn = global_grad_norm(t.params)
    loss = t.accelerator.reduce(loss_sum, reduction="sum") / counts_2[0]
    stats_3 = torch.stack([loss.float(), gn.to(loss.device), counts_2[1]])
    t.inner_optimizer.found_inf = (~torch.isfinite(stats_3[:2]).all()).float().to(gn.device)
    if clip_grad is not None:  # reuses the norm above; no second pass
        torch.nn.utils.clip_grads_with_norm_(t.params, clip_grad, gn)
    measure_layers = tel.layer.due(data.step)
    if measure_layers:
        tel.layer.before_step(t.raw)
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)
    layer_stats_3L = tel.layer.after_step(t.raw) if measure_layers else None
    return StepOut(stats_3, layer_stats_3L, max_LH)


def read_numbers(out: StepOut) -> StepNumbers:
    """The step's one host read: every number it produced, in one transfer."""
    parts = [out.stats_3]
    for t in (out.layer_stats_3L, out.max_LH):
        if t is not None:
            parts.append(t.to(out.stats_3.device, torch.float32).flatten())
    flat = torch.cat(parts).tolist()
    loss, grad_norm, n_tokens = flat[:3]
    rest = flat[3:]
    layer_stats = max_LH = None
    if out.layer_stats_3L is not None:
        n = out.layer_stats_3L.numel()
        layer_stats, rest = _rows(rest[:n], out.layer_stats_3L.shape[1]), rest[n:]
    if out.max_LH is not None:
        max_LH = _rows(rest, out.max_LH.shape[1])
    return StepNumbers(loss, grad_norm, n_tokens, layer_stats, max_LH)


def _rows(flat: list[float], width: int) -> list[list[float]]:
    return [flat[i : i + width] for i in range(0, len(flat), width)]
