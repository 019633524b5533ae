"""Failure mechanisms: logit growth, early transient, other, unknown on synthetic max-logit
series; their edges (no telemetry, divergence at step 0, NaN logits); the report's columns,
its early-transient finding and the per-mechanism counts of the outcome rates."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from stabilitylab.analysis import mechanism as mech
from stabilitylab.analysis.rates import outcome_rates
from stabilitylab.analysis.stats import mechanism_of, warmup_of
from tests.test_analysis import EVERY, diverging_curves, stable_curves, write_arm

STEPS = np.arange(0, 1001, 10)


def _flat(value: float = 2.6) -> np.ndarray:
    return np.full(STEPS.size, value)


def _growing(start: float = 2.5, from_step: int = 300, rate: float = 0.02) -> np.ndarray:
    """Flat at ``start`` until ``from_step``, then e-folds every 1 / rate steps."""
    return start * np.exp(rate * np.clip(STEPS - from_step, 0, None))


# ---- the classes -------------------------------------------------------------------------------


def test_logits_that_grew_before_the_divergence_are_logit_growth():
    logit = _growing()  # 2.5 at step 300, 30 at 300 + ln(12) / 0.02 = 424.2 -> first >= 30 at 430
    got = mech.classify(STEPS, logit, divergence_step=600, warmup_steps=0)
    assert got.label == mech.LOGIT_GROWTH
    assert got.first_logit == pytest.approx(2.5)
    assert got.logit_before == pytest.approx(2.5 * math.exp(0.02 * 300))  # the point at 600
    assert got.growth == pytest.approx(math.exp(6.0))
    assert got.lead_steps == 600 - 430
    # Logits after the divergence step do not count: at step 400 they were x4.9 but only 12.
    early = mech.classify(STEPS, logit, divergence_step=400, warmup_steps=0)
    assert early.label == mech.OTHER and early.logit_before == pytest.approx(2.5 * math.exp(2))
    assert early.lead_steps is None


def test_the_8k_probe_shape_is_an_early_transient():
    # Issue 24: softmax, no warmup, diverged at step 21 with its max logit still 2.6.
    steps = np.arange(0, 25)
    logit = np.full(steps.size, 2.6)
    logit[21:] = np.nan  # the broken step's forward
    got = mech.classify(steps, logit, divergence_step=21, warmup_steps=0)
    assert got.label == mech.EARLY_TRANSIENT
    assert (got.first_logit, got.logit_before, got.growth) == (2.6, 2.6, 1.0)
    assert got.lead_steps is None and "within warmup + 100 = 100" in got.reason


@pytest.mark.parametrize(
    ("warmup", "divergence", "label"),
    [(0, mech.EARLY_STEPS, mech.EARLY_TRANSIENT), (0, mech.EARLY_STEPS + 10, mech.OTHER),
     (500, 550, mech.EARLY_TRANSIENT), (500, 500 + mech.EARLY_STEPS, mech.EARLY_TRANSIENT),
     (500, 610, mech.OTHER), (None, 90, mech.EARLY_TRANSIENT), (None, 110, mech.OTHER)],
)  # fmt: skip
def test_without_growth_the_warmup_window_splits_early_transient_from_other(
    warmup, divergence, label
):
    got = mech.classify(STEPS, _flat(), divergence, warmup)
    assert got.label == label
    assert ("warmup unknown" in got.reason) == (warmup is None)


def test_growth_needs_both_the_factor_and_the_level():
    # x10 but only to 20: not saturated, so not the logit-growth failure.
    small = np.linspace(2.0, 20.0, STEPS.size)
    assert mech.classify(STEPS, small, 800, 0).label == mech.OTHER
    # Above 30 from the start, x1.25: large but not grown.
    large = np.linspace(40.0, 50.0, STEPS.size)
    got = mech.classify(STEPS, large, 800, 0)
    assert got.label == mech.OTHER and got.lead_steps == 800  # crossed 30 at step 0
    # Exactly at both bars: growth.
    edge = np.full(STEPS.size, mech.LOGIT_MIN / mech.GROWTH_MIN)
    edge[50:] = mech.LOGIT_MIN
    got = mech.classify(STEPS, edge, 800, 0)
    assert got.label == mech.LOGIT_GROWTH and got.growth == mech.GROWTH_MIN
    # Growth still counts when it came early: the early window is for failures without it.
    assert mech.classify(STEPS, edge, 520, 0).label == mech.LOGIT_GROWTH


def test_logits_that_spiked_and_settled_do_not_make_a_late_failure_logit_growth():
    logit = _flat(3.0)
    logit[10:20] = 1e3  # steps 100-190
    got = mech.classify(STEPS, logit, divergence_step=900, warmup_steps=0)
    assert got.label == mech.OTHER and got.logit_before == 3.0
    assert got.lead_steps == 800  # the crossing is still reported


def test_no_divergence_is_stable_with_or_without_telemetry():
    assert mech.classify(STEPS, _flat(), None).label == mech.STABLE
    got = mech.classify([], [], None)
    assert got.label == mech.STABLE and math.isnan(got.growth)


# ---- edges -------------------------------------------------------------------------------------


def test_no_logit_telemetry_is_unknown_with_the_reason():
    got = mech.classify([], [], divergence_step=300, warmup_steps=0)
    assert got.label == mech.UNKNOWN and got.reason == "no max-logit telemetry"
    assert math.isnan(got.logit_before) and got.lead_steps is None


def test_divergence_at_step_zero():
    got = mech.classify(STEPS, _growing(from_step=0), divergence_step=0, warmup_steps=0)
    assert got.label == mech.EARLY_TRANSIENT and got.growth == 1.0 and got.lead_steps is None
    # Logits first logged after step 0: nothing to judge by.
    got = mech.classify(STEPS[1:], _flat()[1:], divergence_step=0, warmup_steps=0)
    assert got.label == mech.UNKNOWN and "at or before step 0" in got.reason


def test_nan_logits_are_skipped_not_read_as_growth_or_calm():
    logit = _growing()
    logit[0] = np.nan  # first point missing: the first finite one is the start
    logit[55:61] = np.nan  # steps 550-600: NaN right before and at the divergence
    got = mech.classify(STEPS, logit, divergence_step=600, warmup_steps=0)
    assert got.label == mech.LOGIT_GROWTH and got.first_logit == pytest.approx(2.5)
    assert got.logit_before == pytest.approx(2.5 * math.exp(0.02 * 240))  # step 540
    all_nan = mech.classify(STEPS, np.full(STEPS.size, np.nan), 600, 0)
    assert all_nan.label == mech.UNKNOWN and "no finite max logit" in all_nan.reason
    # A first logit of 0 leaves the growth undefined, so it cannot be logit growth.
    zero = _growing()
    zero[0] = 0.0
    got = mech.classify(STEPS, zero, 600, 0)
    assert math.isnan(got.growth) and got.label == mech.OTHER


@pytest.mark.parametrize(
    ("steps", "logit", "div", "warmup", "match"),
    [([0, 10], [1.0], 5, 0, "equal length"), ([10, 0], [1.0, 2.0], 5, 0, "non-decreasing"),
     ([0, 10], [1.0, 2.0], -1, 0, "divergence_step must be"),
     ([0, 10], [1.0, 2.0], True, 0, "divergence_step must be"),
     ([0, 10], [1.0, 2.0], 5, -3, "warmup_steps must be")],
)  # fmt: skip
def test_bad_input_is_refused_by_name(steps, logit, div, warmup, match):
    with pytest.raises(ValueError, match=match):
        mech.classify(steps, logit, div, warmup)


def test_mechanism_counts_and_the_arm_level_rules():
    labels = ["early transient", "logit growth", "stable", None, "logit growth", "other"]
    assert mech.mechanism_counts(labels) == "logit growth 2, early transient 1, other 1"
    assert mech.mechanism_counts(["stable", None]) is None
    assert mechanism_of("diverged", None, STEPS, _flat(), 0).label == mech.UNKNOWN
    assert mechanism_of("interrupted", None, STEPS, _flat(), 0) is None  # no outcome yet
    assert mechanism_of("stable", None, [], [], None).label == mech.STABLE
    assert mechanism_of("interrupted", 20, STEPS, _flat(), 0).label == mech.EARLY_TRANSIENT
    assert warmup_of({"train": {"warmup_steps": 30}}) == 30
    assert warmup_of({"train": {}}) is None and warmup_of(None) is None


def test_outcome_rates_count_failures_per_mechanism():
    summary = pd.DataFrame(
        {"run": [f"r{i}" for i in range(5)], "arm": "softmax",
         "status": ["diverged", "diverged", "diverged", "stable", "interrupted"],
         "divergence_step": pd.array([600, 21, 700, None, None], dtype="Int64"),
         "first_warning": None,
         "mechanism": ["logit growth", "early transient", "logit growth", "stable", None]}
    )  # fmt: skip
    groups = {(r, "softmax"): "softmax" for r in summary["run"]}
    (row,) = outcome_rates(summary, groups).to_dict("records")
    assert row["diverged"] == "3/4 (logit growth 2, early transient 1)"
    # A table without mechanisms (an older caller) still gets the plain count.
    (row,) = outcome_rates(summary.drop(columns="mechanism"), groups).to_dict("records")
    assert row["diverged"] == "3/4"


# ---- the report --------------------------------------------------------------------------------


def _set_warmup(arm_dir, warmup: int) -> None:
    path = arm_dir / "config.json"
    config = json.loads(path.read_text())
    config["train"]["warmup_steps"] = warmup
    path.write_text(json.dumps(config))


def test_report_shows_each_failures_mechanism_and_lists_early_transients_apart(tmp_path):
    from stabilitylab.analysis.report import write_report

    n = 60
    for seed in range(5):
        if seed < 3:  # logits x1.5 per point from 20 points before the blow-up
            at = 40 + 2 * seed
            steps, loss, gn, logit = diverging_curves(seed, at, n=n)
            summary = {"status": "diverged", "divergence_step": int(steps[at])}
        elif seed == 3:  # blows up at the 3rd point, logits still at their start
            steps, loss, gn, logit = stable_curves(seed, n=n)
            gn[2:] *= 1e4
            loss[2:] = 8.0
            summary = {"status": "diverged", "divergence_step": int(steps[2])}
        else:
            steps, loss, gn, logit = stable_curves(seed, n=n)
            summary = {"status": "stable"}
        arm_dir = write_arm(tmp_path / f"rep_s{seed}" / "softmax", "softmax", steps, loss, gn,
                            logit, layers=1, heads=1, seed=seed, summary=summary)  # fmt: skip
        _set_warmup(arm_dir, 0)

    paths = write_report([tmp_path], tmp_path / "out")
    per_run = pd.read_csv(paths["summary.csv"]).set_index("run")
    for column in ("mechanism", "logit_before_divergence", "logit_growth", "logit_lead_steps"):
        assert column in per_run.columns
    assert list(per_run["mechanism"]) == [mech.LOGIT_GROWTH] * 3 + [mech.EARLY_TRANSIENT, "stable"]
    grown = per_run.iloc[:3]
    assert (grown["logit_growth"] >= mech.GROWTH_MIN).all()
    assert (grown["logit_before_divergence"] >= mech.LOGIT_MIN).all()
    assert (grown["logit_lead_steps"] > 0).all()
    transient = per_run.loc[per_run.index.str.endswith("rep_s3")].iloc[0]
    assert transient["logit_growth"] == 1.0 and transient["divergence_step"] == 2 * EVERY
    assert math.isnan(per_run.iloc[4]["logit_growth"])

    (row,) = pd.read_csv(paths["rates.csv"]).to_dict("records")
    assert row["diverged"] == "4/5 (logit growth 3, early transient 1)"

    text = paths["report.md"].read_text()
    assert "## Failure mechanisms" in text
    finding = text.split("### Early-transient failures (not the logit-growth mechanism)")[1]
    finding = finding.split("## Per arm")[0]
    items = [line for line in finding.splitlines() if line.startswith("- ")]
    assert len(items) == 1 and "rep_s3" in items[0] and "diverged at step 20" in items[0]
    assert "4/5 (logit growth 3, early transient 1)" in text


def test_a_report_of_stable_runs_has_no_mechanism_section(tmp_path):
    from stabilitylab.analysis.report import write_report

    steps, loss, gn, logit = stable_curves(0, n=30)
    write_arm(tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit,
              summary={"status": "stable"})  # fmt: skip
    paths = write_report([tmp_path / "pair"])
    assert "## Failure mechanisms" not in paths["report.md"].read_text()
    assert pd.read_csv(paths["summary.csv"])["mechanism"].tolist() == ["stable"]
