"""Two loss curves of one run compared step by step (the fast step against the eager one).

``curve_gap(reference, other)``: over the steps both curves have, the largest ``|a - b|``, and
over the last ``tail`` of them the mean ``|a - b|`` relative to the reference's mean loss there,
which is the number to hold against rounding noise (bf16 rounds to ~2^-8 = 0.4% relative). A
non-finite point on either side makes the gap infinite: two curves that part there are not the
same curve.
"""

from __future__ import annotations

import math


def curve_gap(reference: list[float], other: list[float], tail: int = 50) -> dict[str, float]:
    """``{"steps", "max_abs", "tail_rel", "final_reference", "final_other"}`` of two per-step
    losses from step 0 on; ``tail`` >= 1."""
    if tail < 1:
        raise ValueError(f"tail must be >= 1, got {tail}")
    n = min(len(reference), len(other))
    if n == 0:
        raise ValueError("curve_gap needs two non-empty curves")
    a, b = reference[:n], other[:n]
    finite = all(math.isfinite(x) for x in (*a, *b))
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    k = min(tail, n)
    ref_tail = sum(a[-k:]) / k
    tail_rel = sum(diffs[-k:]) / k / abs(ref_tail) if finite and ref_tail else math.inf
    return {
        "steps": n,
        "max_abs": max(diffs) if finite else math.inf,
        "tail_rel": tail_rel,
        "final_reference": a[-1],
        "final_other": b[-1],
    }
