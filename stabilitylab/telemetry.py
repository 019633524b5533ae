"""Telemetry: the monitors, throughput and MFU, and the trackers the numbers go to.

Monitors do work only on the steps they measure (``due(step)``); with every cadence at 0 the
trainer runs no hook and no extra reduction. Reductions happen on the device and reach the host
in the step's one read (``stabilitylab.train.step.read_numbers``), not once per metric.
Tag names live in ``stabilitylab.tags``.

Trackers go through accelerate's tracker API: TensorBoard always (event files in the arm dir,
which ``stabilitylab.analysis.events`` reads), plus W&B / MLflow when ``--trackers`` names them.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils import get_total_norm

from stabilitylab import tags
from stabilitylab.model import dense_parameter_count, flops_per_step


def layer_param_groups(model: nn.Module) -> list[list[torch.Tensor]]:
    """Parameters of each encoder block, in order (index i -> ``layer_{i}`` tags)."""
    return [list(block.parameters()) for block in model.blocks]


def _total_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``get_total_norm`` as a plain tensor: over FSDP's sharded parameters and gradients
    (DTensors) it is a DTensor, gathered here (every process then holds the global norm)."""
    from torch.distributed.tensor import DTensor

    norm = get_total_norm(tensors)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _group_norms(tensors_per_group: list[list[torch.Tensor]]) -> torch.Tensor:
    """L2 norm of each group of tensors, on the device: ``norms_G`` (0 for an empty group)."""
    if not tensors_per_group:
        return torch.zeros(0)
    return torch.stack([_total_norm([t.detach() for t in g]) for g in tensors_per_group])


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """Global L2 norm of all gradients (float32, on the device), before any clipping."""
    grads = [p.grad.detach() for p in params if p.grad is not None]
    return _total_norm(grads).float()


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
        """Per head, per layer (max over heads) and overall (max over layers); a NaN head makes
        its layer's and the overall value NaN (``max_keep_nan``)."""
        out = {}
        for i, row in enumerate(max_LH):
            out[tags.layer(tags.MAX_LOGIT_LAYER, i)] = max_keep_nan(row)
            for h, v in enumerate(row):
                out[tags.head(i, h)] = v
        out[tags.MAX_LOGIT] = max_keep_nan([v for row in max_LH for v in row])
        return out


def max_keep_nan(values) -> float:
    """The max of ``values``, NaN if any is NaN. Python's ``max`` drops a NaN that is not first
    (``max(0.0, nan) == 0.0``): a head whose logits broke would vanish from every aggregate."""
    values = [float(v) for v in values]
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def all_reduce_max_keep_nan(x: torch.Tensor, all_reduce_max) -> torch.Tensor:
    """Elementwise max of ``x`` over processes, NaN where any process has a NaN.

    ``all_reduce_max(t)`` reduces ``t`` in place with MAX (``torch.distributed.all_reduce``);
    a MAX reduction need not keep NaN (``fmax``-like, or order-dependent), so each NaN travels as
    a 0/1 flag beside the values, in the same call.
    """
    nan = torch.isnan(x)
    both_2X = torch.stack([torch.where(nan, -math.inf, x), nan.to(x.dtype)])
    all_reduce_max(both_2X)
    return torch.where(both_2X[1] > 0, math.nan, both_2X[0])


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


# ---- throughput and MFU ---------------------------------------------------------------------

# Dense bf16 peak (TFLOPS) by GPU name fragment, for MFU.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "4090": 165.0}


def peak_tflops_for(device_name: str) -> float | None:
    """Dense bf16 peak of the GPU named ``device_name``; None for an unknown GPU."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)


def mfu(flops_per_step: float, step_time_s: float, peak_tflops: float, world: int) -> float:
    """Model FLOPs utilisation: achieved FLOP/s of all processes over their summed peak."""
    return flops_per_step / step_time_s / (peak_tflops * 1e12 * world)


# ---- trackers -------------------------------------------------------------------------------


def missing_trackers(names) -> list[str]:
    """The trackers among ``names`` that are not installed (accelerate would drop them silently)."""
    from accelerate.utils import is_mlflow_available, is_wandb_available

    available = {"wandb": is_wandb_available, "mlflow": is_mlflow_available}
    return [n for n in names if not available[n]()]


def trackers_for(arm_dir: Path, extra, purge_step: int | None, flush_secs: int) -> list:
    """``log_with`` for an arm: TensorBoard writing into ``arm_dir`` (``purge_step``: a resumed
    run hides the killed run's points from that step on), then the optional trackers by name."""
    from accelerate.tracking import TensorBoardTracker

    kwargs = {"flush_secs": flush_secs}
    if purge_step:
        kwargs["purge_step"] = purge_step
    return [TensorBoardTracker(arm_dir.name, arm_dir.parent, **kwargs), *extra]


def start_trackers(accelerator, run_name: str, arm: str, arm_dir: Path, config: dict) -> None:
    """Start the arm's trackers. The config goes to W&B / MLflow only: TensorBoard's hparams
    would add a second event folder inside the arm dir, which the analysis would take for a run."""
    accelerator.init_trackers(
        run_name,
        init_kwargs={
            "wandb": {"name": arm, "group": run_name, "dir": str(arm_dir), "config": config},
            "mlflow": {"run_name": f"{run_name}/{arm}"},
        },
    )
    mlflow = [t for t in accelerator.trackers if t.name == "mlflow"]
    if mlflow:
        mlflow[0].store_init_configuration(_flat(config))


def end_trackers(accelerator) -> None:
    """Close the arm's trackers. ``end_training`` would also tear down the process group, which
    the next arm of the run still needs; the run calls it once, after the last arm."""
    for tracker in accelerator.trackers:
        tracker.finish()
    accelerator.trackers = []


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def gate_scalars(gate_3L: list[list[float]]) -> dict[str, float]:
    """Per gated layer (the layer that emits the gate): mean gate, fraction < 0.05, fraction
    > 0.95; and the mean over layers (each layer counts the same positions)."""
    mean_L, low_L, high_L = gate_3L
    out = {tags.GATE_MEAN: sum(mean_L) / len(mean_L)}
    for i, (m, lo, hi) in enumerate(zip(mean_L, low_L, high_L, strict=True)):
        out[tags.layer(tags.GATE_MEAN_LAYER, i)] = m
        out[tags.layer(tags.GATE_LOW_LAYER, i)] = lo
        out[tags.layer(tags.GATE_HIGH_LAYER, i)] = hi
    return out


def perplexity(loss: float) -> float:
    """``exp(loss)``, infinity past the float range."""
    return math.exp(loss) if loss < 709.0 or not math.isfinite(loss) else math.inf


# ---- one step's scalars ---------------------------------------------------------------------


class StepTelemetry:
    """The monitors of a run and the step -> scalars mapping the trackers receive.

    ``numbers`` is the step's host read (``stabilitylab.train.step.StepNumbers``); ``data`` the
    step's batch (its host-side lengths feed the FLOP count, its first micro-batch the probe).
    """

    def __init__(self, cfg, model: nn.Module, *, world: int, cuda: bool):
        t = cfg.telemetry
        self.log_every, self.world, self.cuda = t.log_every, world, cuda
        self.model_cfg, self.n_dense = cfg.model, dense_parameter_count(model)
        self.gated = cfg.model.gates
        self.layer = LayerStatsMonitor(t.layer_every)
        self.logit = LogitMonitor(t.logit_every)
        self.probe = None
        if t.probe_every > 0:
            from stabilitylab.probes.live import JacobianProbe

            self.probe = JacobianProbe(
                t.probe_every, t.probe_samples, t.probe_tokens, t.probe_iters, seed=cfg.train.seed
            )
        self.peak_tflops = cfg.train.peak_tflops
        if self.peak_tflops is None and cuda:
            self.peak_tflops = peak_tflops_for(torch.cuda.get_device_name())

    def logged(self, step: int) -> bool:
        return bool(self.log_every) and step % self.log_every == 0

    def scalars(self, step: int, numbers, data, step_time_s: float, lr: float, model, main: bool):
        """Tag -> value for this step (empty on a step nothing measures)."""
        out: dict[str, float] = {}
        if not numbers.finite:
            out[tags.NONFINITE] = 1.0
        if self.logged(step):
            out.update(self._throughput(numbers, data, step_time_s))
            out[tags.LOSS], out[tags.GRAD_NORM], out[tags.LR] = numbers.loss, numbers.grad_norm, lr
            if numbers.terms_2 is not None:  # the next-token task: train/loss = CE + budget
                out[tags.CE_LOSS] = numbers.terms_2[0]
                if self.gated:
                    out[tags.BUDGET_LOSS] = numbers.terms_2[1]
        if numbers.gate_3L is not None:
            out.update(gate_scalars(numbers.gate_3L))
        if numbers.val_loss is not None:
            out[tags.VAL_LOSS], out[tags.VAL_PPL] = numbers.val_loss, perplexity(numbers.val_loss)
        if numbers.finite and numbers.layer_stats_3L is not None:
            out.update(LayerStatsMonitor.to_scalars(numbers.layer_stats_3L))
        if numbers.max_LH is not None:
            out.update(LogitMonitor.to_scalars(numbers.max_LH))
        if main and self.probe is not None and self.probe.due(step):
            b = data.micro[0]
            sigmas = self.probe.measure(model, b.tokens_BT, b.lengths_B)
            out.update({tags.layer(tags.JACOBIAN_LAYER, i): s for i, s in sigmas.items()})
        return out

    def _throughput(self, numbers, data, step_time_s: float) -> dict[str, float]:
        out = {
            tags.STEP_TIME: step_time_s,
            tags.TOKENS_PER_S: numbers.n_tokens / step_time_s,
        }
        if self.peak_tflops:
            flops = flops_per_step(self.model_cfg, self.n_dense, data.lengths) * self.world
            out[tags.MFU] = mfu(flops, step_time_s, self.peak_tflops, self.world)
        if self.cuda:  # the allocator's own counter: no device sync
            out[tags.PEAK_MEM] = torch.cuda.max_memory_allocated() / 2**30
        return out
