"""Which mechanism a failure had: logit growth (the paper's story), an early transient, or other.

The paper's failure is *logit growth*: the max attention logit climbs far above its value at
initialisation, softmax rows saturate, and then the gradient norm explodes. A run can also fail
without it: Adam with no (or a short) warmup takes its largest relative steps at the start,
before its second-moment estimate has settled, and can blow up within tens of steps while the
logits are still at their initial size (issue 24's first 8K probe: softmax diverged at step 21
with its max logit at 2.6). Counting both as "softmax diverged" would credit the paper's
mechanism with a failure it did not cause, so each failure is classified:

    logit growth     growth >= GROWTH_MIN and logit_before >= LOGIT_MIN
    early transient  otherwise, if divergence_step <= warmup_steps + EARLY_STEPS
    other            otherwise (diverged later, logits not grown)
    stable           no divergence
    unknown          diverged, but no finite max logit logged at or before the divergence

with, over the finite logged points of the max logit at or before the divergence step:

    first_logit  = the first point (the logit before training moved it)
    logit_before = max of the last ``N_BEFORE`` points
    growth       = logit_before / first_logit
    lead_steps   = divergence_step - the first step whose logit >= LOGIT_MIN (None if none)

"At or before": the logit logged at step s is read in step s's forward, the same forward whose
loss and gradient the divergence rule judged, so it is part of what led to the divergence. The
last points, not the run's maximum, decide: logits that spiked and settled long before a late
failure do not make it a logit-growth failure. Non-finite logits (NaN once the weights broke)
are skipped; they say nothing about the size the logits had.

Pure functions over numpy arrays; ``stats.arm_row`` applies them to one arm of a report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

GROWTH_MIN = 4.0
"""G: the logit must have grown at least 4x over its first logged value. The same factor as
``detectors.logit_runaway``'s default; at initialisation the max |q.k|/sqrt(d) of the lab's
models is O(1) (2.6 in the 8K probe), so x4 is growth no noise of early training gives."""

LOGIT_MIN = 30.0
"""L: ... and reached at least 30. e^30 ~ 1e13: a key 30 above the others takes all of a softmax
row even against 8K keys (e^30 / 8192 ~ 1e9), and a sigmoid at 30 is flat at 1, so both arms'
scores are saturated. The same floor as ``detectors.logit_runaway``'s ``min_value``."""

EARLY_STEPS = 100
"""E: a failure at or before step ``warmup_steps + 100`` without logit growth is an early
transient. Adam's first updates are ~lr per parameter whatever the gradient's size (m / sqrt(v)
of one gradient is its sign), and the 8K probe failed at step 21 with no warmup: 100 steps leave
a margin of ~5x over that, at a peak learning rate that was reached at ``warmup_steps``. The
logit-growth failures seen so far came much later (``diverge_fast``: steps 281 and 665)."""

N_BEFORE = 3
"""How many of the last logged max-logit points before the divergence ``logit_before`` takes
the max of: one point could be a single noisy reading, the whole history would not be the
state the run failed from."""

STABLE, LOGIT_GROWTH, EARLY_TRANSIENT, OTHER, UNKNOWN = (
    "stable", "logit growth", "early transient", "other", "unknown",
)  # fmt: skip
FAILURES = (LOGIT_GROWTH, EARLY_TRANSIENT, OTHER, UNKNOWN)
"""The labels a diverged run can get, in the order the rate tables list them."""


@dataclass(frozen=True)
class Mechanism:
    """A run's failure mechanism and the numbers that decided it (NaN / None: not defined)."""

    label: str
    first_logit: float = math.nan
    logit_before: float = math.nan
    growth: float = math.nan
    lead_steps: int | None = None
    reason: str = ""


def _check(steps_N: np.ndarray, logit_N: np.ndarray) -> None:
    if steps_N.ndim != 1 or steps_N.shape != logit_N.shape:
        raise ValueError(
            f"max-logit steps and values must be 1-D and of equal length, got shapes "
            f"{steps_N.shape} and {logit_N.shape}"
        )
    if steps_N.size > 1 and np.any(np.diff(steps_N) < 0):
        raise ValueError("max-logit steps must be non-decreasing (sort the series by step)")


def logit_numbers(
    steps, logit, divergence_step: int, n_before: int = N_BEFORE
) -> tuple[float, float, float, int | None] | None:
    """``(first_logit, logit_before, growth, lead_steps)`` as defined in the module docstring,
    or None when no finite point lies at or before ``divergence_step``."""
    steps_N = np.asarray(steps, dtype=np.int64)
    logit_N = np.asarray(logit, dtype=np.float64)
    _check(steps_N, logit_N)
    keep_N = (steps_N <= divergence_step) & np.isfinite(logit_N)
    steps_N, logit_N = steps_N[keep_N], logit_N[keep_N]
    if logit_N.size == 0:
        return None
    first = float(logit_N[0])
    before = float(logit_N[-n_before:].max())
    growth = before / first if first > 0 else math.nan
    crossed_N = np.flatnonzero(logit_N >= LOGIT_MIN)
    lead = int(divergence_step - steps_N[crossed_N[0]]) if crossed_N.size else None
    return first, before, growth, lead


def classify(
    steps,
    logit,
    divergence_step: int | None,
    warmup_steps: int | None = 0,
) -> Mechanism:
    """The failure mechanism of one arm from its max-logit series (``steps``, ``logit``: the
    logged steps and max |attention logit|, at any logging cadence), its divergence step
    (None: it did not diverge) and its warmup length (None: unknown, taken as 0 and said so).
    """
    if divergence_step is None:
        return Mechanism(STABLE, reason="no divergence")
    if isinstance(divergence_step, bool) or divergence_step < 0:
        raise ValueError(f"divergence_step must be a step >= 0 or None, got {divergence_step!r}")
    if warmup_steps is not None and warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0 or None, got {warmup_steps!r}")
    divergence_step = int(divergence_step)
    if np.asarray(logit).size == 0:
        return Mechanism(UNKNOWN, reason="no max-logit telemetry")
    numbers = logit_numbers(steps, logit, divergence_step)
    if numbers is None:
        return Mechanism(
            UNKNOWN, reason=f"no finite max logit logged at or before step {divergence_step}"
        )
    first, before, growth, lead = numbers
    grew = growth >= GROWTH_MIN and before >= LOGIT_MIN  # NaN growth compares False
    window = (warmup_steps or 0) + EARLY_STEPS
    if grew:
        label = LOGIT_GROWTH
        reason = f"max logit {first:.3g} -> {before:.3g} (x{growth:.3g}) at or before step {divergence_step}"
    else:
        label = EARLY_TRANSIENT if divergence_step <= window else OTHER
        reason = (
            f"max logit {first:.3g} -> {before:.3g} (needs x{GROWTH_MIN:g} and >= {LOGIT_MIN:g}); "
            f"diverged at step {divergence_step}, "
            + ("within" if label == EARLY_TRANSIENT else "after")
            + f" warmup + {EARLY_STEPS} = {window}"
        )
        if warmup_steps is None:
            reason += " (warmup unknown, taken as 0)"
    return Mechanism(label, first, before, growth, lead, reason)


def mechanism_counts(labels) -> str | None:
    """``"logit growth 2, early transient 1"``: the failure labels counted in ``FAILURES`` order
    (others last, alphabetically); None when there are none. ``stable`` and missing labels are
    not counted."""
    labels = [x for x in labels if isinstance(x, str) and x != STABLE]
    if not labels:
        return None
    order = [*FAILURES, *sorted(set(labels) - set(FAILURES))]
    return ", ".join(f"{m} {labels.count(m)}" for m in order if m in labels)
