"""Bootstrap and seed intervals on constructed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stabilitylab.analysis.intervals import (
    Interval,
    paired_ppl_difference,
    ppl,
    ppl_interval,
    seed_interval,
    t_quantile,
)

W = 256  # scored tokens per window


def windows(n, mean_nll, spread, rng):
    """Per-window NLL sums: a shared per-window difficulty around ``mean_nll`` per token."""
    return (mean_nll + spread * rng.standard_normal(n)) * W


def test_ppl_is_exp_of_the_token_weighted_mean():
    nll_N, tok_N = np.array([2.0 * 10, 3.0 * 30]), np.array([10, 30])
    assert math.isclose(ppl(nll_N, tok_N), math.exp((20 + 90) / 40))


def test_a_shift_every_window_shares_is_decided_though_the_windows_spread_more():
    """Policy a is 0.01 nats per token worse on every window; windows differ by 0.3 nats. The
    unpaired spread would hide the shift, the paired interval must not."""
    rng = np.random.default_rng(0)
    b = windows(200, 3.5, 0.3, rng)
    a = b + 0.01 * W
    tok = np.full(200, W)
    iv = paired_ppl_difference(a, b, tok, seed=1)
    exact = ppl(a, tok) - ppl(b, tok)
    assert iv.estimate == pytest.approx(exact)
    assert 0 < iv.lo <= exact <= iv.hi
    assert iv.verdict == "a > b"
    alone_a, alone_b = ppl_interval(a, tok, seed=1), ppl_interval(b, tok, seed=1)
    assert alone_a.lo < alone_b.hi  # unpaired intervals overlap


def test_noise_without_a_shift_is_undecided_and_covers_zero():
    rng = np.random.default_rng(2)
    b = windows(300, 3.5, 0.3, rng)
    a = b + rng.normal(0, 0.05, 300) * W  # independent noise per window, no shift
    iv = paired_ppl_difference(a, b, np.full(300, W), seed=3)
    assert iv.lo < 0 < iv.hi and iv.verdict == "undecided"
    assert paired_ppl_difference(b, a, np.full(300, W), seed=3).verdict == "undecided"


def test_the_interval_has_roughly_its_coverage():
    """Over 100 resampled studies of a known population, the 95% interval of the PPL covers the
    population PPL in 85-100 of them (a broken quantile or a wrong pairing falls far outside)."""
    rng = np.random.default_rng(4)
    population = windows(20000, 3.5, 0.4, rng)
    truth = ppl(population, np.full(20000, W))
    hits = 0
    for k in range(100):
        sample = rng.choice(population, 150)
        iv = ppl_interval(sample, np.full(150, W), n_boot=500, seed=k)
        hits += iv.lo <= truth <= iv.hi
    assert 85 <= hits <= 100


def test_nan_propagates_to_the_bounds():
    a = np.array([1.0, np.nan, 2.0]) * W
    iv = paired_ppl_difference(a, np.array([1.0, 1.0, 2.0]) * W, np.full(3, W))
    assert math.isnan(iv.estimate) and math.isnan(iv.lo) and math.isnan(iv.hi)
    assert iv.verdict == "undecided"


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="one length"):
        paired_ppl_difference(np.ones(3), np.ones(4), np.ones(3))
    with pytest.raises(ValueError, match="no window"):
        ppl_interval(np.ones(0), np.ones(0))


def test_seed_interval_is_the_t_interval():
    iv = seed_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)
    assert iv == Interval(2.0, 2.0 - half, 2.0 + half)
    assert math.isnan(seed_interval([1.0]).lo)
    assert math.isnan(seed_interval([1.0, math.nan, 2.0]).hi)
    assert t_quantile(2) == 4.303 and t_quantile(100) == 1.96
