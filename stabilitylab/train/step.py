"""One optimizer step: forward/backward over the micro-batches, the update, the one host read.

The loss is the mean over every predicted token of the global batch (masked cells, or next-token
targets): each micro-batch's summed cross-entropy is scaled by ``world / n_predicted`` (DDP
averages gradients over processes), so one process and N processes at the same global batch
follow the same curve. A gated model (the KV-eviction study) adds the budget term
``lambda * mean gate`` (``model.budget_loss``: ``train.budget_norm`` says whether over the gate
layers it is a mean or a sum over a reference depth), the mean over gated layers, heads and every
valid position of the global batch: each micro-batch's term times its valid positions, scaled by
``world / n_valid``. lambda is the step's (``build.budget_lambda_at``: the ramp), a Python number
the step multiplies outside the compiled forward. ``train/loss`` is the sum of the two terms; both
are returned apart too.

Nothing in :func:`train_step` waits for the device (the fast path's chunked loss too: the
number of labelled rows comes from the host's count). The update is skipped on the device when
the loss or a gradient is not finite (AdamW's ``found_inf``, as GradScaler uses it), so the host
reads the step's numbers once, in :func:`read_numbers`, after the update is queued.

``train.fast`` (``Trainee.fast``): the forward through the compiled model and the loss through the
chunked cross-entropy (:func:`summed_ce`, ``stabilitylab.train.fast``); everything else here is
the same code for both steps. Validation runs the plain module eagerly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stabilitylab.data.batch import Batch
from stabilitylab.data.loader import StepBatch
from stabilitylab.model import budget_loss, masked_lm_loss_sum, next_token_loss_sum
from stabilitylab.probes.gates import GateSums, gate_stats, gate_sums
from stabilitylab.telemetry import StepTelemetry, all_reduce_max_keep_nan, global_grad_norm
from stabilitylab.train.build import Trainee
from stabilitylab.train.fast import summed_ce_fast


@dataclass
class StepOut:
    """What a step leaves on the device."""

    stats_3: torch.Tensor
    """float32 ``[loss, global grad norm (before clipping), valid tokens of all processes]``."""
    layer_stats_3L: torch.Tensor | None
    """Per-layer grad norm, parameter norm, update ratio (steps the layer monitor measures)."""
    max_LH: torch.Tensor | None
    """Max |attention logit| per layer and head over all processes (logit-monitor steps)."""
    terms_2: torch.Tensor | None = None
    """Next-token task: ``[mean CE, budget term]`` (the budget is 0 without gates)."""
    gate_3L: torch.Tensor | None = None
    """Gated models on logged steps: per gated layer the mean gate, the fraction of gates < 0.05
    and > 0.95 (``stabilitylab.probes.gates``), over valid positions of all processes."""
    val_2: torch.Tensor | None = None
    """Validation steps: ``[summed CE, targets]`` over the validation batches, all processes."""


@dataclass
class StepNumbers:
    """The same numbers on the host."""

    loss: float
    grad_norm: float
    n_tokens: float
    layer_stats_3L: list[list[float]] | None
    max_LH: list[list[float]] | None
    terms_2: list[float] | None = None
    gate_3L: list[list[float]] | None = None
    val_loss: float | None = None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def summed_ce(t: Trainee, data: StepBatch, i: int) -> torch.Tensor:
    """Summed cross-entropy of micro-batch ``i`` over its labelled positions (masked cells or
    next-token targets: one function), float32; the fast path's when ``t.fast`` is set."""
    b = data.micro[i]
    if t.fast is None:
        return masked_lm_loss_sum(t.model(b.tokens_BT, b.lengths_B), b.labels_BT)
    B = b.tokens_BT.shape[0]
    host_lengths = data.lengths[i * B : (i + 1) * B]
    return summed_ce_fast(t.fast, t.raw, b, host_lengths, t.accelerator.autocast)


def _loss_and_backward(t: Trainee, data: StepBatch, n_masked: torch.Tensor, tel: StepTelemetry):
    """Summed masked-token loss of this process's micro-batches; gradients accumulated."""
    loss_sum = torch.zeros((), device=n_masked.device)
    for i in range(len(data.micro)):
        last = i == len(data.micro) - 1
        with t.no_sync(last):
            part = summed_ce(t, data, i)
            t.accelerator.backward(part * (t.world / n_masked))
        loss_sum += part.detach()
        if tel.logit.due(data.step):
            tel.logit.collect(t.raw)
    return loss_sum


def step_gate_sums(gates: list[torch.Tensor], lengths_B: torch.Tensor) -> GateSums:
    """``probes.gates.gate_sums`` of one forward's gates; per-head gates ``g_BHT`` count every
    (sequence, head) as a row."""
    if gates[0].dim() == 3:
        H = gates[0].shape[1]
        return gate_sums([g.flatten(0, 1) for g in gates], lengths_B.repeat_interleave(H))
    return gate_sums(gates, lengths_B)


def _lm_loss_and_backward(
    t: Trainee, data: StepBatch, counts_2: torch.Tensor, tel: StepTelemetry, budget_lambda: float
):
    """Next-token task: ``(sums_2, gate sums)``, ``sums_2`` = this process's summed CE and summed
    budget term (``budget_loss * valid positions`` per micro-batch, at ``budget_lambda``);
    gradients of their global means accumulated. Gate sums on logged steps of a gated model, else
    None."""
    want_gates = tel.logged(data.step)
    sums_2 = torch.zeros(2, device=counts_2.device)
    sums: GateSums | None = None
    for i, b in enumerate(data.micro):
        last = i == len(data.micro) - 1
        with t.no_sync(last):
            ce = summed_ce(t, data, i)
            loss = ce * (t.world / counts_2[0])
            budget = torch.zeros((), device=counts_2.device)
            gates = t.raw.gates
            if gates:
                norm = (t.budget_norm, t.budget_ref_layers)
                budget = budget_loss(gates, b.lengths_B, budget_lambda, *norm) * b.lengths_B.sum()
                loss = loss + budget * (t.world / counts_2[1])
                if want_gates:
                    part = step_gate_sums(gates, b.lengths_B)
                    sums = part if sums is None else sums + part
            t.accelerator.backward(loss)
        sums_2 += torch.stack([ce.detach(), budget.detach()])
        if tel.logit.due(data.step):
            tel.logit.collect(t.raw)
    return sums_2, sums


def _gate_stats_3L(t: Trainee, sums: GateSums) -> torch.Tensor:
    """Rows mean, frac < 0.05, frac > 0.95 per gated layer, over all processes' valid positions."""
    if t.world > 1:
        stacked_4L = torch.stack([sums.total_L, sums.low_L, sums.high_L, sums.count_L])
        stacked_4L = t.accelerator.reduce(stacked_4L, reduction="sum")
        sums = GateSums(*stacked_4L.unbind(0))
    stats = gate_stats(sums)
    return torch.stack([stats["mean_L"], stats["frac_low_L"], stats["frac_high_L"]]).float()


@torch.no_grad()
def validation_sums(t: Trainee, batches: list[Batch]) -> torch.Tensor:
    """``[summed next-token CE, targets]`` over ``batches`` (this process's share of the fixed
    validation batches), summed over processes. Eval mode: no dropout, so no random draw, and
    the training trajectory is the same with or without validation."""
    model, device = t.raw, t.accelerator.device
    sums_2 = torch.zeros(2, device=device)
    was_training = model.training
    model.eval()
    try:
        with t.accelerator.autocast():
            for b in batches:
                b = b.to(device, non_blocking=True)
                logits_BTV = model(b.tokens_BT, b.lengths_B)
                sums_2[0] += next_token_loss_sum(logits_BTV, b.labels_BT)
                sums_2[1] += b.n_masked
    finally:
        model.train(was_training)
    return t.accelerator.reduce(sums_2, reduction="sum") if t.world > 1 else sums_2


def train_step(
    t: Trainee,
    data: StepBatch,
    lr: float,
    clip_grad: float | None,
    tel: StepTelemetry,
    budget_lambda: float | None = None,
) -> StepOut:
    """One update from ``data`` (already on the device); returns the step's device numbers.
    ``budget_lambda``: this step's lambda of a gated model's budget term (the trainer passes the
    ramped value); None = ``t.budget_lambda``, the full one."""
    counts_2 = data.counts_2
    if t.world > 1:
        counts_2 = t.accelerator.reduce(counts_2, reduction="sum")
    for g in t.optimizer.param_groups:
        g["lr"] = lr
    log_logits = tel.logit.due(data.step)
    if log_logits:
        tel.logit.attach(t.raw)
    terms_2 = gate_3L = None
    if t.task == "lm":
        lam = t.budget_lambda if budget_lambda is None else budget_lambda
        sums_2, sums = _lm_loss_and_backward(t, data, counts_2, tel, lam)
        sums_2 = t.accelerator.reduce(sums_2, reduction="sum")
        terms_2 = sums_2 / counts_2
        loss = terms_2.sum()
        gate_3L = _gate_stats_3L(t, sums) if sums is not None else None
    else:
        loss_sum = _loss_and_backward(t, data, counts_2[0], tel)
    max_LH = tel.logit.detach(t.raw) if log_logits else None
    if max_LH is not None and t.world > 1:
        max_LH = all_reduce_max_keep_nan(
            max_LH, lambda x: torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        )

    gn = global_grad_norm(t.params)
    if t.task != "lm":
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
    return StepOut(stats_3, layer_stats_3L, max_LH, terms_2, gate_3L)


def read_numbers(out: StepOut) -> StepNumbers:
    """The step's one host read: every number it produced, in one transfer."""
    optional = {
        "layer_stats_3L": out.layer_stats_3L,
        "max_LH": out.max_LH,
        "terms_2": out.terms_2,
        "gate_3L": out.gate_3L,
        "val_2": out.val_2,
    }
    parts = [out.stats_3]
    for t in optional.values():
        if t is not None:
            parts.append(t.to(out.stats_3.device, torch.float32).flatten())
    flat = torch.cat(parts).tolist()
    loss, grad_norm, n_tokens = flat[:3]
    rest, got = flat[3:], {}
    for name, t in optional.items():
        if t is not None:
            n = t.numel()
            got[name], rest = rest[:n], rest[n:]
    matrices = ("layer_stats_3L", "max_LH", "gate_3L")
    rows = {k: _rows(v, optional[k].shape[1]) for k, v in got.items() if k in matrices}
    val_loss = None
    if "val_2" in got:
        total, count = got["val_2"]
        val_loss = total / count if count else float("nan")
    return StepNumbers(
        loss, grad_norm, n_tokens, rows.get("layer_stats_3L"), rows.get("max_LH"),
        got.get("terms_2"), rows.get("gate_3L"), val_loss,
    )  # fmt: skip


def _rows(flat: list[float], width: int) -> list[list[float]]:
    return [flat[i : i + width] for i in range(0, len(flat), width)]
