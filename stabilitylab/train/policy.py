"""What the trainer does about what telemetry saw: non-finite steps and the divergence rule.

The detector (what counts as a divergence) is ``stabilitylab.analysis.detectors.diverged``, the
same pure function the offline report runs; this module is the policy (what to do about it):

- a non-finite loss or gradient: the update was already skipped on the device; the first one is
  recorded with the first module whose output was not finite, and a forensic checkpoint keeps
  the weights and history from before it;
- the detector firing on the history so far (every logged step): recorded, forensic checkpoint;
- then ``train.on_divergence`` decides: ``stop``, or ``continue`` (a run still stops after
  ``MAX_CONSECUTIVE_NONFINITE`` non-finite steps in a row: nothing would change any more).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from stabilitylab.analysis.detectors import diverged
from stabilitylab.telemetry import max_keep_nan

MAX_CONSECUTIVE_NONFINITE = 20


@dataclass
class History:
    """Per-step loss and global grad norm: what the policy reads. Plain lists and numbers, so a
    checkpoint holding it loads with ``torch.load(weights_only=True)``."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    max_logit: float = 0.0
    """Max |attention logit| over every logged step; NaN once one was NaN (it stays NaN)."""
    nonfinite_steps: list[int] = field(default_factory=list)
    wall_time_s: float = 0.0
    """Training time of every run segment that led here (resumes add up)."""
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    """Validation passes (the next-token task): after which step, mean CE over the val windows."""
    last: dict[str, float] = field(default_factory=dict)
    """The last logged value of the next-token task's terms: ce_loss, budget_loss, gate_mean,
    gate_frac_binary (for the summary)."""
    gate_mean_L: list[float] = field(default_factory=list)
    """Gated models: each gate layer's mean gate at the last logged step (the dead-layer check)."""

    def append(self, step: int, loss: float, grad_norm: float, max_LH) -> None:
        self.steps.append(step)
        self.loss.append(loss)
        self.grad_norm.append(grad_norm)
        if max_LH is not None:
            self.max_logit = max_keep_nan([self.max_logit, *(v for row in max_LH for v in row)])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.nonfinite_steps.append(step)

    def append_val(self, step: int, loss: float) -> None:
        self.val_steps.append(step)
        self.val_loss.append(loss)

    def before(self, step: int) -> History:
        """The history of the steps before ``step``."""
        n = sum(s < step for s in self.steps)
        n_val = sum(s < step for s in self.val_steps)
        return History(
            steps=self.steps[:n],
            loss=self.loss[:n],
            grad_norm=self.grad_norm[:n],
            max_logit=self.max_logit,
            nonfinite_steps=[s for s in self.nonfinite_steps if s < step],
            wall_time_s=self.wall_time_s,
            val_steps=self.val_steps[:n_val],
            val_loss=self.val_loss[:n_val],
            last=dict(self.last),
            gate_mean_L=list(self.gate_mean_L),
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Divergence:
    step: int
    reason: str
    module: str | None
    """First module whose output was not finite (non-finite steps only)."""


SaveForensic = Callable[[str, int, History, dict], None]
"""``save(name, step, history, extra)``: writes a checkpoint next to ``last``."""


class Policy:
    """Reads each step's numbers after telemetry recorded them; says whether to stop."""

    def __init__(self, cfg, hist: History, save_forensic: SaveForensic, say: Callable[[str], None]):
        self.on_divergence = cfg.train.on_divergence
        self.log_every = cfg.telemetry.log_every
        self.hist, self.save_forensic, self.say = hist, save_forensic, say
        self.status = "stable"
        self.divergence: Divergence | None = None
        self.consecutive_nonfinite = 0

    def after_step(
        self, step: int, loss: float, grad_norm: float, locate: Callable[[], str | None], batch
    ) -> bool:
        """True when the run must stop. ``locate()`` names the first non-finite module (one
        extra forward pass); ``batch`` is ``[first global sample index, samples per process]``."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.consecutive_nonfinite += 1
            if self.divergence is None:
                reason = "non-finite " + ("loss" if not math.isfinite(loss) else "gradient")
                module = locate() or ("backward" if math.isfinite(loss) else None)
                # The update was skipped: the weights are those before this step, and so is the
                # history the forensic checkpoint keeps; resuming from it replays this step.
                d = Divergence(step, reason, module)
                self._diverge(d, step, step, self.hist.before(step), {"batch_indices": batch})
            return (
                self.on_divergence == "stop"
                or self.consecutive_nonfinite >= MAX_CONSECUTIVE_NONFINITE
            )
        self.consecutive_nonfinite = 0
        if self.divergence is not None or not self.log_every or step % self.log_every:
            return False
        h = self.hist
        steps_N = np.asarray(h.steps)
        det = diverged(steps_N, np.asarray(h.loss), steps_N, np.asarray(h.grad_norm))
        if det is None:
            return False
        d = Divergence(int(det.step), f"{det.detector}: {det.detail}", None)
        self._diverge(d, step, step + 1, self.hist, {})
        return self.on_divergence == "stop"

    def _diverge(self, d: Divergence, step: int, ckpt_step: int, hist: History, extra: dict):
        """Record the divergence and keep a forensic checkpoint: once per run."""
        self.status, self.divergence = "diverged", d
        extra = {"divergence": asdict(d), **extra}
        self.save_forensic(f"forensic_step{step}", ckpt_step, hist, extra)
        where = f" (first module: {d.module})" if d.module else ""
        self.say(f"diverged at step {d.step}: {d.reason}{where}")
