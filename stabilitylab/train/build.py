"""What an arm trains with: the accelerator, the model, the optimizer and its schedule.

Mixed precision: ``accelerate launch`` always passes one on (its ``--mixed_precision`` flag, the
``--config_file`` YAML, or the ``accelerate config`` default file), as does
ACCELERATE_MIXED_PRECISION set by hand; that value rules. ``train.precision`` applies only when
none is set (a plain ``python`` run): auto = bf16 autocast on CUDA, fp32 on CPU.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from stabilitylab.config import Config, ConfigError
from stabilitylab.model import HEAD_ROW_MULTIPLE, TokenGate, Transformer
from stabilitylab.telemetry import trackers_for
from stabilitylab.train import sharding
from stabilitylab.train.fast import FastForward

SUPPORTED_PRECISION = ("no", "bf16")  # fp16 would need a loss scaler the step does not run


def mixed_precision(cfg: Config, cuda: bool) -> tuple[str, str]:
    """accelerate's mixed-precision mode for this run and where it came from."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if launched:
        if launched not in SUPPORTED_PRECISION:
            raise ConfigError(
                f"config mixed precision: {launched!r} from accelerate (launch config or "
                f"ACCELERATE_MIXED_PRECISION) is not supported; use one of {SUPPORTED_PRECISION}"
            )
        return launched, "accelerate launch / ACCELERATE_MIXED_PRECISION"
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if cuda else "fp32"
    return ("bf16" if precision == "bf16" else "no"), "train.precision"


def apply_determinism(cfg: Config) -> None:
    """``train.deterministic`` for this process, on or off (the config decides each arm):
    ``torch.use_deterministic_algorithms``, which makes an op with no deterministic kernel raise,
    naming itself, and which the Triton kernels read at launch to pin their configs; and the
    fixed cuBLAS workspace that deterministic matmuls need (CUDA reads it when it first creates a
    cuBLAS handle, so before the first matmul; a value already set is kept)."""
    if cfg.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(cfg.train.deterministic)


def make_accelerator(cfg: Config, arm_dir: Path, purge_step: int | None):
    """An Accelerator whose trackers write this arm's events into ``arm_dir``; under an FSDP
    launch, with the trainer's FSDP plugin (``sharding``), on a CPU host too."""
    from accelerate import Accelerator

    cuda = torch.cuda.is_available()
    fsdp = sharding.plugin() if sharding.requested() else None
    accelerator = Accelerator(
        cpu=not cuda,
        mixed_precision=mixed_precision(cfg, cuda)[0],
        step_scheduler_with_optimizer=False,
        log_with=trackers_for(arm_dir, cfg.trackers, purge_step, cfg.telemetry.flush_secs),
        project_dir=str(arm_dir),
        fsdp_plugin=fsdp,
    )
    if fsdp is not None and not cuda:
        sharding.enable_on_cpu(accelerator, fsdp)
    return accelerator


def accumulation_steps(cfg: Config, world: int) -> int:
    per_step = cfg.train.micro_batch * world
    if cfg.train.global_batch % per_step:
        raise ConfigError(
            f"config train.global_batch: {cfg.train.global_batch} is not a multiple of "
            f"train.micro_batch ({cfg.train.micro_batch}) x processes ({world})"
        )
    return cfg.train.global_batch // per_step


def build_model(cfg: Config, backend: str, vocab: int) -> Transformer:
    torch.manual_seed(cfg.train.seed)
    return Transformer(cfg.model, vocab, cfg.data.context_len, backend)


def weights_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def lr_at(cfg: Config, step: int) -> float:
    """The lr of ``step`` (0-based): linear warmup ``peak * (step + 1) / W`` over the first ``W =
    warmup_steps`` steps, then with ``lr_decay=none`` the peak (the stress paper's schedule), with
    ``cosine`` ``floor + (peak - floor) * (1 + cos(pi * p)) / 2``, ``p = (step - W) / (S - 1 -
    W)`` clipped to [0, 1], ``floor = min_lr_ratio * peak``, ``S = train.steps``: the peak at
    step W, the floor at the last step S - 1."""
    t = cfg.train
    peak, w = t.peak_lr, t.warmup_steps
    if step < w:
        return peak * (step + 1) / w
    if t.lr_decay == "none":
        return peak
    p = min(1.0, max(0.0, (step - w) / max(1, t.steps - 1 - w)))
    floor = t.min_lr_ratio * peak
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


def budget_ramp_factor(cfg: Config, step: int) -> float:
    """The share of lambda at ``step``: ``min(1, step / R)``, ``R = budget_ramp * train.steps``
    (0 at step 0, 1 from step R on); 1 throughout when ``budget_ramp`` is 0."""
    ramp_steps = cfg.train.budget_ramp * cfg.train.steps
    return min(1.0, step / ramp_steps) if ramp_steps > 0 else 1.0


def budget_lambda_at(cfg: Config, step: int) -> float:
    """The budget term's lambda at ``step``: ``budget_lambda`` times the ramp's share. The step
    passes it as a Python number to a term computed outside any compiled graph (the fast step
    compiles the model's forward only), so a new value each step recompiles nothing."""
    return cfg.train.budget_lambda * budget_ramp_factor(cfg, step)


def gate_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every parameter of the model's gate modules (``TokenGate``: weight and bias)."""
    return [p for m in model.modules() if isinstance(m, TokenGate) for p in m.parameters()]


def make_optimizer(cfg: Config, model: torch.nn.Module) -> torch.optim.Optimizer:
    # Weight decay on matrices and embeddings only; biases and LayerNorm gains are not decayed,
    # nor, with train.gate_weight_decay=False, any gate parameter.
    t = cfg.train
    exempt = set() if t.gate_weight_decay else {id(p) for p in gate_parameters(model)}
    decay = [p for p in model.parameters() if p.ndim >= 2 and id(p) not in exempt]
    no_decay = [p for p in model.parameters() if p.ndim < 2 or id(p) in exempt]
    # fused: one kernel per step, and it honours ``found_inf`` (the update is skipped on the
    # device when a gradient is not finite; see stabilitylab.train.step).
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": t.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=lr_at(cfg, 0),
        betas=(t.beta1, t.beta2),
        eps=t.eps,
        fused=True,
    )


@dataclass
class Trainee:
    """The prepared model and optimizer of one arm, and the handles the step needs."""

    accelerator: object
    model: torch.nn.Module
    """As accelerate prepared it (DDP-wrapped on several processes; under FSDP the model itself,
    its parameters sharded)."""
    raw: torch.nn.Module
    """The plain model: monitors and probes attach here."""
    optimizer: torch.optim.Optimizer
    inner_optimizer: torch.optim.Optimizer
    """The torch optimizer under accelerate's wrapper: ``found_inf`` is set on it."""
    params: list[torch.nn.Parameter]
    accum: int
    task: str = "mlm"
    """``Config.task``: mlm (masked cells) or lm (next tokens, with the budget term when gated)."""
    budget_lambda: float = 0.0
    """``train.budget_lambda``: the budget term's full lambda (gated models); the trainer passes
    each step's ramped value (``budget_lambda_at``) to the step instead."""
    budget_norm: str = "mean"
    """``train.budget_norm``: mean or per_gate (``model.budget_loss``)."""
    budget_ref_layers: int = 12
    """``train.budget_ref_layers``: per_gate's reference depth."""
    fast: FastForward | None = None
    """``train.fast``: the compiled forward the step calls (``stabilitylab.train.fast``); None =
    the eager step. ``raw`` stays the plain module, which validation and the probes call."""

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    def no_sync(self, last: bool):
        """The context of a micro-batch's forward and backward. DDP: no all-reduce before the
        step's last micro-batch (the gradients add up locally). FSDP: each micro-batch's
        gradient is reduce-scattered into the shards at once (accelerate's ``no_sync`` would keep
        a whole unsharded gradient on every process until the last one)."""
        if last or sharding.is_sharded(self.model):
            return contextlib.nullcontext()
        return self.accelerator.no_sync(self.model)


def prepare(cfg: Config, accelerator, model: torch.nn.Module, accum: int) -> Trainee:
    """The arm's Trainee. ``train.fast``: the one-pass q/k/v gradient on, the head's rows padded
    (``HEAD_ROW_MULTIPLE``), and the prepared model
    wrapped by ``torch.compile`` for the step's forward (``FastForward``); ``model`` itself
    stays eager."""
    optimizer = make_optimizer(cfg, model)
    if cfg.train.compile:
        model.compile()  # in place: DDP wraps it as usual and the hooks see the same modules
    if cfg.train.fast:
        model.set_one_pass_qkv_grad(True)
        model.set_head_row_multiple(HEAD_ROW_MULTIPLE)
    model, optimizer = accelerator.prepare(model, optimizer)
    if sharding.is_sharded(model):
        sharding.autocast_forward(model, accelerator)
    raw = accelerator.unwrap_model(model)
    fast = None
    if cfg.train.fast:
        fast = FastForward(model, say=accelerator.print)
        accelerator.print(
            "fast path: torch.compile (fullgraph, dynamic sequence length), chunked "
            f"cross-entropy, head rows padded to a multiple of {HEAD_ROW_MULTIPLE}, one-pass "
            "q/k/v gradient (--train.fast=False: the eager step)"
        )
    return Trainee(
        accelerator=accelerator,
        model=model,
        raw=raw,
        optimizer=optimizer,
        inner_optimizer=getattr(optimizer, "optimizer", optimizer),
        params=list(raw.parameters()),
        accum=accum,
        task=cfg.task,
        budget_lambda=cfg.train.budget_lambda,
        budget_norm=cfg.train.budget_norm,
        budget_ref_layers=cfg.train.budget_ref_layers,
        fast=fast,
    )
