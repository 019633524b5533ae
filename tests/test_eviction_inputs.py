"""The eviction API takes real numbers and whole budgets and refuses the rest by name: a NaN or
fractional budget (NaN would evict nothing), a bool for tau (``True`` is not tau = 1); numpy's
real scalars pass like Python's."""

import numpy as np
import pytest
import torch

from stabilitylab.eviction import (
    H2O,
    Budget,
    DecodeSplit,
    GateThreshold,
    KeyDiff,
    Split,
    decode_nll,
)
from stabilitylab.eviction.cache import LayerCache
from stabilitylab.eviction.protocol import check_grid


@pytest.mark.parametrize("tau", [np.float32(0.5), np.float64(0.5), np.int64(1), 0.5, 0])
def test_numpy_and_python_reals_are_taus(tau):
    policy = GateThreshold(tau)
    assert policy.tau == float(tau) and type(policy.tau) is float
    assert policy.name == f"gate(tau={float(tau):g})"


@pytest.mark.parametrize("tau", [True, False, np.bool_(True), float("nan"), torch.tensor(0.5)])
def test_bools_nan_and_tensors_are_not_taus(tau):
    with pytest.raises(ValueError, match=r"tau must be a number in \[0, 1\]"):
        GateThreshold(tau)


def test_h2o_fraction_is_a_real_number():
    assert H2O(np.float32(0.25)).heavy_fraction == 0.25
    for bad in (True, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="heavy_fraction must be in"):
            H2O(bad)


def test_a_grid_with_a_bool_is_refused():
    assert check_grid([np.float32(0.5), 0]) == (0.0, 0.5)
    with pytest.raises(ValueError, match="got True"):
        check_grid([0.0, True])


def cache_with(live: int) -> LayerCache:
    """One sequence, one head, ``live`` live entries of a 4-dim key, a random score each."""
    cache = LayerCache.empty(
        1, 1, 4, dtype=torch.float32, device="cpu", gated=False, track_scores=True
    )
    k = torch.randn(1, 1, live, 4)
    cache.append(k, k.clone(), torch.arange(live), None)
    cache.add_scores(torch.rand(1, 1, 1, live))
    return cache


@pytest.mark.parametrize("policy", [H2O(), KeyDiff()], ids=["h2o", "keydiff"])
@pytest.mark.parametrize(
    "keep_B, match",
    [
        (torch.tensor([float("nan")]), "whole entry counts, got nan"),
        (torch.tensor([2.5]), "whole entry counts, got 2.5"),
        (torch.tensor([True]), "dtype torch.bool"),
        (torch.tensor([-1]), "counts >= 0, got -1"),
    ],
)
def test_a_budget_that_is_not_whole_entries_is_refused(policy, keep_B, match):
    with pytest.raises(ValueError, match=match):
        policy.drop_BHN(cache_with(6), keep_B)


@pytest.mark.parametrize("policy", [H2O(), KeyDiff()], ids=["h2o", "keydiff"])
def test_a_whole_float_budget_keeps_that_many(policy):
    drop = policy.drop_BHN(cache_with(6), torch.tensor([4.0]))
    assert int(drop.sum()) == 2


def test_a_budget_from_a_run_must_be_whole_entries():
    decode = DecodeSplit(prefill=4, window=4)
    Budget(Split.VAL, decode, (0,), np.array([[8, 6]]), "ok")
    for live in (np.array([[8.0, float("nan")]]), np.array([[8.5, 6.0]])):
        with pytest.raises(ValueError, match="budget live_NL must hold whole entry counts"):
            Budget(Split.VAL, decode, (0,), live, "bad")


def test_the_decode_refuses_a_nan_budget_before_it_casts_to_long():
    from tests.test_eviction import random_tokens, tiny_decoder

    dense = tiny_decoder(0, gates=False)
    keep_BL = torch.full((3, 3), 5.0)
    keep_BL[1, 2] = float("nan")  # .long() would make it -2**63: every entry would go
    with pytest.raises(
        ValueError, match=r"keep_BL must hold whole entry counts, got nan at index \(1, 2\)"
    ):
        decode_nll(dense, random_tokens(0), 8, H2O(), keep_BL=keep_BL)
