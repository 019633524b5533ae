"""Telemetry: one TensorBoard writer and the monitors that feed it.

Monitors do work only on the steps they measure (``due(step)``); with every cadence at 0 the
trainer runs no hook and no extra reduction. Reductions happen on the device and are brought to
the host once per logged step (``.tolist()`` on one stacked tensor), not once per metric.
Tag names live in ``stabilitylab.tags``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from stabilitylab import tags


class Writer:
    """TensorBoard scalars, main process only (a no-op elsewhere). Flushed every few seconds."""

    def __init__(self, log_dir: Path | None, flush_secs: int = 5):
        self._w = None
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._w = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_secs)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self._w is None:
            return
        for tag, v in values.items():
            self._w.add_scalar(tag, v, step)

    def flush(self) -> None:
        if self._w is not None:
            self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()


def layer_param_groups(model: nn.Module) -> list[list[torch.Tensor]]:
    """Parameters of each encoder block, in order (index i -> ``layer_{i}`` tags)."""
    return [list(block.parameters()) for block in model.blocks]


def _group_norms(tensors_per_group: list[list[torch.Tensor]]) -> torch.Tensor:
    """L2 norm of each group of tensors, on the device: ``norms_G``."""
    flat = [t for g in tensors_per_group for t in g]
    if not flat:
        return torch.zeros(0)
    norms = torch._foreach_norm([t.detach().float() for t in flat])
    out, i = [], 0
    for g in tensors_per_group:
        out.append(torch.linalg.vector_norm(torch.stack(norms[i : i + len(g)])))
        i += len(g)
    return torch.stack(out)


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients (float32, on the device), before any clipping."""
    grads = [p.grad.detach().float() for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


class LayerStatsMonitor:
    """Per-layer grad norms, parameter norms and update-to-weight ratios ``||dW|| / ||W||``.

    ``before_step`` snapshots the layer weights (only on due steps), ``after_step`` measures.
    """

    def __init__(self, every: int):
        self.every = every
        self._snapshot: list[list[torch.Tensor]] | None = None
        self._grad_norms: torch.Tensor | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def before_step(self, model: nn.Module) -> None:
        groups = layer_param_groups(model)
        self._grad_norms = _group_norms([[p.grad for p in g if p.grad is not None] for g in groups])
        self._snapshot = [[p.detach().clone() for p in g] for g in groups]

    def after_step(self, model: nn.Module) -> torch.Tensor:
        """Returns ``stats_3L``: rows grad norm, param norm, update ratio (on the device)."""
        groups = layer_param_groups(model)
        param_norms = _group_norms(groups)
        deltas = [
            [p.detach() - old for p, old in zip(g, snap, strict=True)]
            for g, snap in zip(groups, self._snapshot, strict=True)
        ]
        before = _group_norms(self._snapshot)
        ratio = _group_norms(deltas) / before.clamp_min(1e-30)
        self._snapshot = None
        return torch.stack([self._grad_norms.to(ratio.device), param_norms, ratio])

    @staticmethod
    def to_scalars(stats_3L: list[list[float]]) -> dict[str, float]:
        out = {}
        for i, (g, p, r) in enumerate(zip(*stats_3L, strict=True)):
            out[tags.layer(tags.GRAD_NORM_LAYER, i)] = g
            out[tags.layer(tags.PARAM_NORM_LAYER, i)] = p
            out[tags.layer(tags.UPDATE_RATIO_LAYER, i)] = r
        return out


class LogitMonitor:
    """Exact per-layer, per-head max |attention logit| over all valid pairs of the step's batch.

    The attention backends compute it (fused in the Triton kernel, chunked elsewhere) when
    ``model.set_record_max_logit(True)``; this monitor switches that on for due steps only and
    folds the micro-batches together: ``max_LH``.
    """

    def __init__(self, every: int):
        self.every = every
        self._max_LH: torch.Tensor | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def attach(self, model: nn.Module) -> None:
        model.set_record_max_logit(True)
        self._max_LH = None

    def collect(self, model: nn.Module) -> None:
        per_layer = [a.max_logit_BH.amax(dim=0) for a in model.attention_layers]
        m_LH = torch.stack(per_layer)
        self._max_LH = m_LH if self._max_LH is None else torch.maximum(self._max_LH, m_LH)

    def detach(self, model: nn.Module) -> torch.Tensor | None:
        model.set_record_max_logit(False)
        out, self._max_LH = self._max_LH, None
        return out

    @staticmethod
    def to_scalars(max_LH: list[list[float]]) -> dict[str, float]:
        out = {}
        for i, row in enumerate(max_LH):
            out[tags.layer(tags.MAX_LOGIT_LAYER, i)] = max(row)
            for h, v in enumerate(row):
                out[tags.head(i, h)] = v
        out[tags.MAX_LOGIT] = max(max(r) for r in max_LH)
        return out


def first_nonfinite_module(model: nn.Module, run_forward) -> str | None:
    """Name of the first module (in execution order) whose output holds a non-finite value.

    ``run_forward()`` runs one forward pass; hooks are attached for it only. Used after a
    non-finite loss or gradient to say where the numbers broke.
    """
    found: list[str] = []
    handles = []

    def hook(name):
        def fn(_mod, _inp, out):
            if found:
                return
            outs = out if isinstance(out, (tuple, list)) else (out,)
            for o in outs:
                if torch.is_tensor(o) and o.is_floating_point() and not torch.isfinite(o).all():
                    found.append(name)
                    return

        return fn

    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        with torch.no_grad():
            run_forward()
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None
