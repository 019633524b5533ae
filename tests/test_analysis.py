"""Analysis: detectors on synthetic curves, event reading, report and sweep on fake runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from torch.utils.tensorboard import SummaryWriter

from stabilitylab import tags
from stabilitylab.analysis import detectors as det
from stabilitylab.analysis.early_warning import early_warning, first_warning
from stabilitylab.analysis.events import (
    COLUMNS,
    TruncatedEventsWarning,
    layer_tags,
    load_config,
    load_runs,
    load_summary,
    select,
)
from stabilitylab.analysis.sweep import lr_sensitivity, sweep_table

REPO = Path(__file__).resolve().parent.parent
EVERY = 10  # logging cadence (steps) of the synthetic curves


# ---- synthetic curves --------------------------------------------------------------------------


def stable_curves(seed: int, n: int = 600):
    """Noisy but healthy run: decaying loss, log-normal grad norm, slowly growing logits."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n) * EVERY
    loss = 5.0 * np.exp(-np.arange(n) / 150) + 2.0 + 0.05 * rng.standard_normal(n)
    gn = np.exp(0.25 * rng.standard_normal(n)) * (1 + 2 * np.exp(-np.arange(n) / 30))
    logit = 5.0 * (1 + np.arange(n) / n) * np.exp(0.05 * rng.standard_normal(n))
    return steps, loss, gn, logit


def diverging_curves(seed: int, at: int, n: int = 600):
    """Stable curves until index ``at``; then grad norm x1e4, loss back to 8, logits x1.5/point."""
    steps, loss, gn, logit = stable_curves(seed, n)
    gn[at:] *= 1e4
    loss[at:] = 8.0
    k = np.arange(n - at + 20)
    logit[at - 20 :] *= 1.5**k
    return steps, loss, gn, logit


def floor_trap_curves(seed: int = 0, n: int = 600):
    """Stable curves (``stable_curves``, plus a slowly growing Jacobian norm) with the three
    shapes each false-alarm floor is there for; every detector must stay silent on them:

    * from index 450 the loss and grad norm repeat one value exactly (a bf16-rounded log), and
      from 560 sit 0.1 % / 2 % above it: a rolling std of 0 makes that step infinitely many
      sigmas without ``rolling_sigma``'s ``min_rel_std`` and ``grad_explosion_zscore``'s
      ``min_std`` floors;
    * the first logits grow from 0.5 to 5 (x10 in 4 points), far below ``logit_runaway``'s
      ``min_value`` of 30.
    """
    steps, loss, gn, logit = stable_curves(seed, n)
    loss[450:] = loss[450]
    loss[560:] *= 1.001
    gn[450:] = 1.0
    gn[560:] = 1.02
    logit[:5] = [0.5, 1.0, 2.0, 4.0, 5.0]
    jac = 2.0 * (1 + np.arange(n) / n) * np.exp(0.05 * np.random.default_rng(seed).normal(size=n))
    return steps, loss, gn, logit, jac


# ---- detectors ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_injected_divergence_is_found_by_each_detector(seed):
    at = 400
    steps, loss, gn, logit = diverging_curves(seed, at)
    s_at = int(steps[at])

    # Exact: each fires on the first bad point.
    assert det.diverged(steps, loss, steps, gn).step == s_at
    assert det.grad_explosion_ratio(steps, gn).step == s_at
    assert det.grad_explosion_zscore(steps, gn).step == s_at
    assert det.rolling_sigma(steps, loss).step == s_at
    # On log-normal grad norms a linear k-sigma rule may false-alarm first (heavy right tail);
    # on Gaussian noise it is exact.
    assert det.rolling_sigma(steps, gn).step <= s_at
    gauss = 1.0 + 0.1 * np.random.default_rng(seed).standard_normal(gn.size)
    gauss[at:] *= 1e4
    assert det.rolling_sigma(steps, gauss).step == s_at
    # Smoothed over 5 points: fires within them.
    hit = det.loss_divergence(steps, loss)
    assert s_at <= hit.step <= s_at + 5 * EVERY, hit
    # Logits start growing 20 points before: x4 needs log(4)/log(1.5) ~ 3.4 points of growth.
    hit = det.logit_runaway(steps, logit)
    assert s_at - 20 * EVERY < hit.step <= s_at - 16 * EVERY, hit

    lossnan = loss.copy()
    lossnan[at + 7] = np.nan
    assert det.nonfinite(steps, lossnan).step == int(steps[at + 7])


@pytest.mark.parametrize("seed", range(6))
def test_stable_noisy_curves_raise_no_divergence(seed):
    steps, loss, gn, logit = stable_curves(seed)
    # A single grad spike the run absorbs (loss stays low) is not a divergence.
    gn[300] *= 5e3
    assert det.diverged(steps, loss, steps, gn) is None
    assert det.loss_divergence(steps, loss) is None
    assert det.logit_runaway(steps, logit) is None


def test_loss_divergence_catches_a_slow_climb_back_above_the_start():
    steps, loss, _, _ = stable_curves(4)
    loss0 = loss[:5].mean()
    loss[300:] = np.linspace(loss[300], loss0 + 2.0, 300)  # climbs for longer than `window`
    cross = 300 + int(np.argmax(loss[300:] >= loss0))
    # With the jump rule switched off, "back above initial" still fires at the crossing.
    hit = det.loss_divergence(steps, loss, jump=100.0)
    assert hit is not None and "above initial" in hit.detail
    assert abs(hit.step - steps[cross]) <= 5 * EVERY, (hit, steps[cross])
    # By default the jump rule (half the recent progress given back) fires earlier.
    early = det.loss_divergence(steps, loss)
    assert steps[300] < early.step < hit.step and "jump" in early.detail


def test_loss_blowup_fires_on_a_sustained_blowup_after_learning_only():
    steps, loss, gn, _ = stable_curves(5)
    assert det.loss_blowup(steps, loss) is None
    loss0 = loss[:5].mean()
    blown = loss.copy()
    blown[400:460] = 12 * loss0  # the diverge_fast sigmoid seed-3 shape: loss ~12x its start
    gn_up = gn.copy()
    gn_up[400:] *= 100  # a 100x grad-norm rise: the run-level rule stays silent
    assert det.diverged(steps, blown, steps, gn_up) is None
    hit = det.loss_blowup(steps, blown)
    assert hit is not None and hit.step == steps[404]  # the 5th high point in a row
    # Four high points are a spike, not a blow-up.
    spike = loss.copy()
    spike[400:404] = 12 * loss0
    assert det.loss_blowup(steps, spike) is None
    # A high start that settles (large init, no warmup) does not fire...
    early = loss.copy()
    early[1:30] = 6 * loss0
    assert det.loss_blowup(steps, early) is None
    # ...but one that never comes down does, after sustain_cold points (50 by default).
    cold = loss.copy()
    cold[1:] = 6 * loss0
    hit = det.loss_blowup(steps, cold)
    assert hit is not None and hit.step == steps[50] and "from the start" in hit.detail
    with pytest.raises(ValueError, match="factor"):
        det.loss_blowup(steps, loss, factor=0)


def test_diverged_needs_loss_above_initial_and_prefers_the_earliest_cause():
    steps, loss, gn, _ = stable_curves(0)
    gn[500:] *= 1e4  # explosion, but the loss keeps going down
    assert det.diverged(steps, loss, steps, gn) is None
    loss[520:] = 9.0
    hit = det.diverged(steps, loss, steps, gn)
    assert hit.step == steps[520] and hit.detector == "grad_explosion+loss"
    gn[510] = np.inf  # a non-finite grad norm before the loss condition holds wins
    hit = det.diverged(steps, loss, steps, gn)
    assert (hit.step, hit.detector) == (steps[510], "nonfinite")
    assert "grad norm" in hit.detail


def _diverged_brute(steps, loss, gn, ratio=1e3, n_initial=5, min_history=3):
    """The rule of ``detectors.diverged`` for finite inputs, written out point by point."""
    loss0 = loss[:n_initial].mean()
    ready = steps[n_initial - 1]
    for i in range(min_history, len(gn)):
        j = np.searchsorted(steps, steps[i], side="right") - 1
        if steps[i] >= ready and loss[j] >= loss0 and gn[i] >= ratio * np.median(gn[:i]):
            return int(steps[i])
    return None


def test_diverged_matches_a_point_by_point_reference():
    found = 0
    for seed in range(200):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(8, 250))
        steps = np.arange(n) * 3
        gn = np.exp(rng.standard_normal(n) * rng.uniform(0.5, 5.0))
        loss = 4.0 + rng.standard_normal(n)
        ratio = float(rng.choice([3.0, 30.0, 1e3]))
        hit = det.diverged(steps, loss, steps, gn, grad_ratio=ratio)
        expected = _diverged_brute(steps, loss, gn, ratio)
        assert (hit.step if hit else None) == expected, seed
        found += expected is not None
    assert found > 20  # the cases exercise the firing branch, not only "no alarm"


def test_diverged_online_prefix_agrees_with_offline():
    steps, loss, gn, _ = diverging_curves(3, at=350)
    full = det.diverged(steps, loss, steps, gn)
    for end in (100, 349, 351, 600):
        online = det.diverged(steps[:end], loss[:end], steps[:end], gn[:end])
        assert (online.step if online else None) == (full.step if end > 350 else None)


def test_detectors_reject_bad_input():
    with pytest.raises(ValueError, match="differ in length"):
        det.nonfinite([0, 1, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        det.rolling_sigma([0, 2, 1], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="window"):
        det.grad_explosion_ratio([0, 1], [1.0, 1.0], window=0)
    assert det.diverged([], [], [], []) is None


def test_every_detector_is_silent_on_stable_curves_with_floor_traps():
    steps, loss, gn, logit, jac = floor_trap_curves()
    on = {"nonfinite": loss, "loss_divergence": loss, "grad_explosion_ratio": gn,
          "grad_explosion_zscore": gn, "logit_runaway": logit, "jacobian_growth": jac,
          "rolling_sigma": loss}  # fmt: skip
    assert set(on) == set(det.DETECTORS)
    fired = {name: fn(steps, on[name]) for name, fn in det.DETECTORS.items()}
    assert fired == dict.fromkeys(det.DETECTORS), fired
    assert det.rolling_sigma(steps, gn) is None  # the report's grad_sigma reads it too
    assert det.diverged(steps, loss, steps, gn) is None and det.loss_blowup(steps, loss) is None


def test_the_false_alarm_floors_are_what_keep_the_traps_silent():
    """Each trap of ``floor_trap_curves`` fires once its floor is (nearly) removed: the floors,
    not some other part of the rule, keep the previous test silent."""
    steps, loss, gn, logit, _ = floor_trap_curves()
    s560 = int(steps[560])
    assert det.grad_explosion_zscore(steps, gn, min_std=1e-300).step == s560
    assert det.rolling_sigma(steps, gn, min_rel_std=1e-300).step == s560
    assert det.rolling_sigma(steps, loss, min_rel_std=1e-300).step == s560
    assert det.logit_runaway(steps, logit, min_value=0.0).step == int(steps[4])
    # The floors' scale: a step of 6 floors' worth does fire with the defaults.
    gn[560:] = np.exp(6 * 0.05) * 1.0001
    assert det.grad_explosion_zscore(steps, gn).step == s560
    loss[560:] = loss[450] * (1 + 6 * 0.01) * 1.0001
    assert det.rolling_sigma(steps, loss).step == s560


def test_jacobian_growth_fires_on_x4_within_4_points_and_not_on_slow_growth():
    steps, _, _, _, jac = floor_trap_curves()
    assert det.jacobian_growth(steps, jac) is None  # x2 over the whole run
    jac[300:] *= 1.5 ** np.minimum(np.arange(300), 10)  # x1.5 per point from index 300
    hit = det.jacobian_growth(steps, jac)
    # x4 within 4 points needs 4 steps of x1.5 (x5.06) against jitter of a few %: index 304.
    assert hit is not None and hit.step == int(steps[304]) and hit.detector == "jacobian_growth"
    assert "over 40 steps" in hit.detail


# ---- event files -------------------------------------------------------------------------------


def write_arm(
    d: Path,
    arm: str,
    steps,
    loss,
    gn,
    logit=None,
    *,
    layers: int = 2,
    heads: int = 2,
    lr: float = 1e-3,
    seed: int = 0,
    qk_ln: bool = False,
    summary: dict | None = None,
    logit_every: int = 5,
) -> Path:
    """An arm dir as the trainer writes it: config.json, real-tag event file, summary.json."""
    d.mkdir(parents=True, exist_ok=True)
    config = {
        "arm": arm, "backend": arm, "preset": "smoke", "name": d.parent.name,
        "model": {"qk_layernorm": qk_ln}, "data": {}, "telemetry": {},
        "train": {"lr": lr, "lr_scale": 1.0, "seed": seed},
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    w = SummaryWriter(str(d), flush_secs=3600)
    for i, s in enumerate(steps):
        w.add_scalar(tags.LOSS, float(loss[i]), int(s))
        w.add_scalar(tags.GRAD_NORM, float(gn[i]), int(s))
        if logit is not None and i % logit_every == 0:
            for layer in range(layers):
                per_head = [float(logit[i]) * (1 + 0.1 * h) / (1 + layer) for h in range(heads)]
                for h, v in enumerate(per_head):
                    w.add_scalar(tags.head(layer, h), v, int(s))
                w.add_scalar(tags.layer(tags.MAX_LOGIT_LAYER, layer), max(per_head), int(s))
            w.add_scalar(tags.MAX_LOGIT, float(logit[i]) * (1 + 0.1 * (heads - 1)), int(s))
    w.close()
    if summary is not None:
        (d / "summary.json").write_text(json.dumps({"arm": arm, "backend": arm, **summary}))
    return d


def test_real_event_files_parse_into_the_tidy_frame(tmp_path):
    steps = np.arange(6) * EVERY
    loss = np.array([8.0, 7.0, np.nan, np.inf, 5.0, 4.0])
    gn = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    write_arm(
        tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit=gn * 10, logit_every=2
    )
    write_arm(tmp_path / "pair" / "sigmoid", "sigmoid", steps, loss - 1, gn, logit=None)

    df = load_runs([tmp_path / "pair"])
    assert list(df.columns) == COLUMNS
    assert df["step"].dtype == np.int64 and df["value"].dtype == np.float64
    assert set(map(tuple, df[["run", "arm"]].drop_duplicates().to_numpy())) == {
        ("pair", "softmax"), ("pair", "sigmoid")
    }  # fmt: skip
    soft = select(df, "pair", "softmax")
    got = soft[soft["tag"] == tags.LOSS].sort_values("step")["value"].to_numpy()
    np.testing.assert_array_equal(got[[0, 1, 4, 5]], loss[[0, 1, 4, 5]])
    assert np.isnan(got[2]) and np.isposinf(got[3])
    assert layer_tags(soft["tag"].unique()) == {
        0: tags.layer(tags.MAX_LOGIT_LAYER, 0),
        1: tags.layer(tags.MAX_LOGIT_LAYER, 1),
    }
    assert layer_tags(soft["tag"].unique(), tags.JACOBIAN_LAYER) == {}
    head = soft[soft["tag"] == tags.head(1, 1)].sort_values("step")
    np.testing.assert_allclose(head["value"], gn[::2] * 10 * 1.1 / 2, rtol=1e-6)
    assert not (select(df, "pair", "sigmoid")["tag"].str.startswith("attn/")).any()

    # The arm dir alone gives the same rows for that arm.
    alone = load_runs(tmp_path / "pair" / "softmax")
    pd.testing.assert_frame_equal(alone.reset_index(drop=True), soft.reset_index(drop=True))
    assert load_config(tmp_path / "pair" / "softmax")["train"]["lr"] == 1e-3
    assert load_summary(tmp_path / "pair" / "softmax") is None


def test_resumed_run_keeps_the_value_written_last(tmp_path):
    d = tmp_path / "r" / "softmax"
    write_arm(d, "softmax", [0, 10, 20], [3.0, 2.0, 1.0], [1.0, 1.0, 1.0])
    time.sleep(1.1)  # event file names carry the creation second
    w = SummaryWriter(str(d))
    w.add_scalar(tags.LOSS, 9.0, 20)
    w.add_scalar(tags.LOSS, 8.0, 30)
    w.close()
    df = load_runs(d)
    loss = df[df["tag"] == tags.LOSS].set_index("step")["value"]
    assert loss.to_dict() == {0: 3.0, 10: 2.0, 20: 9.0, 30: 8.0}


def test_truncated_event_file_keeps_what_came_before_with_one_warning(tmp_path):
    d = write_arm(tmp_path / "cut" / "softmax", "softmax", np.arange(40), np.ones(40), np.ones(40))
    (f,) = d.glob("events.out.tfevents.*")
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 30])  # inside the last record (each is > 30 bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        df = load_runs(d)
    cut = [w for w in caught if issubclass(w.category, TruncatedEventsWarning)]
    assert len(cut) == 1 and str(f) in str(cut[0].message)
    grad = df[df["tag"] == tags.GRAD_NORM]["step"]
    loss = df[df["tag"] == tags.LOSS]["step"]
    assert sorted(loss) == list(range(40)) and sorted(grad) == list(range(39))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_runs(write_arm(tmp_path / "whole" / "softmax", "softmax", [0], [1.0], [1.0]))


def test_empty_or_missing_run_dir_errors_name_the_path(tmp_path):
    empty = tmp_path / "empty_run"
    (empty / "softmax" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="empty_run"):
        load_runs([empty])
    with pytest.raises(FileNotFoundError, match="no_such_run"):
        load_runs([tmp_path / "no_such_run"])

    cli = subprocess.run(
        [sys.executable, str(REPO / "analysis" / "report.py"), str(empty)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},  # this tree, whatever is installed
    )
    assert cli.returncode == 2
    assert cli.stderr.strip().count("\n") == 0 and "empty_run" in cli.stderr
    assert "Traceback" not in cli.stderr


def test_summary_nonfinite_strings_become_floats(tmp_path):
    d = tmp_path / "s"
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"status": "diverged", "max_grad_norm": "inf"}))
    assert load_summary(d)["max_grad_norm"] == math.inf


# ---- early warning, report, sweep -------------------------------------------------------------


def _frame(steps, loss, gn, logit=None, jac=None) -> pd.DataFrame:
    rows = [("r", "a", s, tags.LOSS, v) for s, v in zip(steps, loss, strict=True)]
    rows += [("r", "a", s, tags.GRAD_NORM, v) for s, v in zip(steps, gn, strict=True)]
    for tag, values in ((tags.MAX_LOGIT_LAYER, logit), (tags.JACOBIAN_LAYER, jac)):
        if values is not None:
            rows += [
                ("r", "a", s, tags.layer(tag, 0), v) for s, v in zip(steps, values, strict=True)
            ]
    return pd.DataFrame(rows, columns=COLUMNS)


def test_early_warning_leads_and_false_alarms():
    at = 400
    table = early_warning(_frame(*diverging_curves(0, at)))
    by = table.set_index("precursor")
    div = at * EVERY
    assert (by["divergence_step"] == div).all()
    assert by.loc["logit_runaway/layer_0", "lead_steps"] > 0  # logits grew before the blow-up
    assert by.loc["logit_runaway/max", "step"] == by.loc["logit_runaway/layer_0", "step"]
    assert by.loc["grad_zscore", "lead_steps"] == 0
    assert by.loc["loss_divergence", "lead_steps"] <= 0
    assert first_warning(table)[0] == "logit_runaway/layer_0"

    # The trainer's verdict, when given, replaces detection: None = it judged the run stable.
    told = early_warning(_frame(*diverging_curves(0, at)), divergence_step=None)
    assert told["divergence_step"].isna().all() and told["lead_steps"].isna().all()
    assert told["step"].notna().any()  # precursors still reported (as false alarms)
    with pytest.raises(ValueError, match="divergence_step"):
        early_warning(_frame(*stable_curves(0)), divergence_step="auto")

    stable = early_warning(_frame(*stable_curves(0)))
    assert stable["divergence_step"].isna().all() and stable["lead_steps"].isna().all()

    # No precursor fires on the floor traps. Told of a divergence at the last step, any that
    # did would lead it and be named: (None, None) holds only if every precursor stayed silent.
    steps, *curves = floor_trap_curves()
    quiet = early_warning(_frame(steps, *curves), divergence_step=int(steps[-1]))
    assert len(quiet) == 8 and "jacobian_growth/layer_0" in set(quiet["precursor"])
    assert quiet["step"].isna().all(), quiet[quiet["step"].notna()]
    assert first_warning(quiet) == (None, None)


def test_write_report_on_a_fake_paired_run(tmp_path):
    from stabilitylab.analysis.report import REPORT_FILES, write_report

    n, at = 120, 80
    steps, loss, gn, logit = diverging_curves(0, at, n=n)
    write_arm(
        tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit,
        summary={"status": "diverged", "divergence_step": int(steps[at]), "max_grad_norm": "inf"},
    )  # fmt: skip
    s_steps, s_loss, s_gn, _ = stable_curves(1, n=n)
    write_arm(tmp_path / "pair" / "sigmoid", "sigmoid", s_steps, s_loss, s_gn, logit=None)

    paths = write_report([tmp_path / "pair"])
    assert set(paths) == set(REPORT_FILES)
    assert all(
        p.parent == tmp_path / "pair" / "report" and p.stat().st_size > 0 for p in paths.values()
    )
    summary = pd.read_csv(paths["summary.csv"]).set_index("arm")
    assert summary.loc["softmax", "status"] == "diverged"
    assert summary.loc["softmax", "divergence_step"] == steps[at]
    assert summary.loc["softmax", "detected_step"] == steps[at]
    assert summary.loc["softmax", "grad_norm_growth"] > 1e3
    assert summary.loc["sigmoid", "status"] == "unfinished"  # no summary.json, no divergence
    assert summary.loc["softmax", "mechanism"] == "logit growth"  # x1.5 per point before
    assert pd.isna(summary.loc["sigmoid", "mechanism"])  # no outcome yet, no mechanism
    assert pd.isna(summary.loc["sigmoid", "max_logit"])
    scalars = pd.read_csv(paths["scalars.csv"])
    assert list(scalars.columns) == COLUMNS and len(scalars) == len(load_runs(tmp_path / "pair"))
    text = paths["report.md"].read_text()
    assert "sigmoid: no per-layer max-logit telemetry" in text
    assert "| softmax | diverged |" in text.replace("| pair ", "")


def test_report_keeps_arms_without_data_and_names_cut_files(tmp_path):
    from stabilitylab.analysis.report import write_report

    steps, loss, gn, logit = stable_curves(0, n=60)
    write_arm(tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit)
    # An arm whose event file was never written, one whose file holds no scalar, one cut short.
    gone = tmp_path / "pair" / "sigmoid"
    write_arm(gone, "sigmoid", [], [], [], summary={"status": "interrupted", "steps": 0})
    for f in gone.glob("events.out.tfevents.*"):
        f.unlink()
    blank = write_arm(tmp_path / "blank" / "softmax", "softmax", [], [], [])
    (blank_file,) = blank.glob("events.out.tfevents.*")
    blank_file.write_bytes(b"")
    cut = write_arm(tmp_path / "cut" / "softmax", "softmax", steps, loss, gn)
    (cut_file,) = cut.glob("events.out.tfevents.*")
    cut_file.write_bytes(cut_file.read_bytes()[:-30])

    with pytest.warns(TruncatedEventsWarning, match="cut mid-record"):
        paths = write_report([tmp_path / "pair", tmp_path / "blank", tmp_path / "cut"])
    summary = pd.read_csv(paths["summary.csv"])
    by = summary.set_index(["run", "arm"])["status"]
    assert by[("pair", "sigmoid")] == "interrupted" and by[("blank", "softmax")] == "no data"
    assert len(summary) == 4
    text = paths["report.md"].read_text()
    missing = text.split("## Missing or cut data")[1].split("## Per arm")[0]
    assert f"`{gone}` (run `pair`, arm `sigmoid`): no event file" in missing
    assert f"`{blank}` (run `blank`, arm `softmax`): its event file(s) hold no scalar" in missing
    assert "cut mid-record" in missing and str(cut_file) in missing


def test_report_without_missing_data_has_no_missing_section(tmp_path):
    from stabilitylab.analysis.report import write_report

    steps, loss, gn, logit = stable_curves(0, n=30)
    write_arm(tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit)
    (tmp_path / "pair" / "softmax" / "checkpoints").mkdir()
    (tmp_path / "pair" / "softmax" / "checkpoints" / "config.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_report([tmp_path / "pair"])
    assert "Missing or cut data" not in paths["report.md"].read_text()
    assert len(pd.read_csv(paths["summary.csv"])) == 1


def test_sweep_score_orders_robust_before_fragile():
    rows = []
    # variant, lr, final, initial, diverged
    for lr, final in [(1e-3, 3.0), (3e-3, 2.9), (1e-2, 3.1)]:
        rows.append(("robust", 0, lr, final, 8.0, False))
    for lr, final in [(1e-3, 3.0), (3e-3, 4.0), (1e-2, float("nan"))]:
        rows.append(("fragile", 0, lr, final, 8.0, not math.isfinite(final)))
    for lr in (1e-3, 1e-2):
        rows.append(("dead", 0, lr, float("nan"), 8.0, True))
    table = pd.DataFrame(
        rows, columns=["variant", "seed", "lr", "final_loss", "initial_loss", "diverged"]
    )
    table["clipped_loss"] = np.where(
        table["diverged"],
        table["initial_loss"],
        np.minimum(table["final_loss"], table["initial_loss"]),
    )
    score = lr_sensitivity(table).set_index("variant")["lr_sensitivity"]
    assert score["robust"] == pytest.approx((0.1 + 0.0 + 0.2) / 3)
    assert score["fragile"] == pytest.approx((0.0 + 1.0 + 5.0) / 3)  # diverged counts at 8.0
    assert score["robust"] < score["fragile"]
    assert math.isnan(score["dead"])
    with pytest.raises(ValueError, match="clipped_loss"):
        lr_sensitivity(table.drop(columns="clipped_loss"))


def test_sweep_table_groups_by_variant_and_seed(tmp_path):
    n = 60
    for lr in (1e-3, 1e-2):
        steps, loss, gn, _ = diverging_curves(0, 40, n=n) if lr == 1e-2 else stable_curves(0, n=n)
        write_arm(tmp_path / f"lr{lr:g}" / "softmax", "softmax", steps, loss, gn, lr=lr)
        steps, loss, gn, _ = stable_curves(1, n=n)
        write_arm(tmp_path / f"qk{lr:g}" / "softmax", "softmax", steps, loss, gn, lr=lr, qk_ln=True)
    table = sweep_table([tmp_path])
    assert sorted(table["variant"].unique()) == ["softmax", "softmax+qk-ln"]
    bad = table[table["diverged"]]
    assert list(zip(bad["variant"], bad["lr"], strict=True)) == [("softmax", 1e-2)]
    assert bad["clipped_loss"].iloc[0] == pytest.approx(bad["initial_loss"].iloc[0])
    score = lr_sensitivity(table).set_index("variant")["lr_sensitivity"]
    assert score["softmax+qk-ln"] < score["softmax"]

    from stabilitylab.analysis.sweep import write_sweep

    paths = write_sweep([tmp_path])
    assert sorted(paths) == ["sweep.csv", "sweep.md", "sweep.png"]
    assert all(p.parent == tmp_path / "sweep" and p.stat().st_size > 0 for p in paths.values())
    assert len(pd.read_csv(paths["sweep.csv"])) == 4


def test_sweep_output_defaults_to_beside_the_runs_not_their_common_parent(tmp_path):
    from stabilitylab.analysis.sweep import write_sweep

    steps, loss, gn, _ = stable_curves(0, n=30)
    first = write_arm(tmp_path / "a" / "runs" / "lr1" / "softmax", "softmax", steps, loss, gn)
    write_arm(tmp_path / "b" / "lr2" / "softmax", "softmax", steps, loss, gn, lr=1e-2)
    paths = write_sweep([first.parent, tmp_path / "b" / "lr2"])
    assert paths["sweep.md"].parent == tmp_path / "a" / "runs" / "sweep"
    assert not (tmp_path / "sweep").exists()


def test_sweep_include_merges_an_earlier_table_new_runs_win(tmp_path):
    from stabilitylab.analysis.sweep import write_sweep

    n = 60
    steps, loss, gn, _ = stable_curves(0, n=n)
    write_arm(tmp_path / "new" / "a" / "softmax", "softmax", steps, loss, gn, lr=1e-2)
    old = sweep_table([tmp_path / "new"])
    old["run"] = "earlier"
    old.loc[0, "final_loss"] = old.loc[0, "clipped_loss"] = 99.0  # superseded by the new run
    extra = old.assign(lr=1e-3, final_loss=1.0, clipped_loss=1.0)  # only in the earlier table
    earlier = pd.concat([old, extra]).drop(columns=["max_grad_norm", "max_logit"])  # older format
    earlier.to_csv(tmp_path / "earlier.csv", index=False)
    paths = write_sweep([tmp_path / "new"], tmp_path / "out", [tmp_path / "earlier.csv"])
    merged = pd.read_csv(paths["sweep.csv"])
    assert list(merged["lr"]) == [1e-3, 1e-2]
    assert list(merged["run"]) == ["earlier", "a"]
    assert merged["final_loss"].iloc[1] != 99.0
    assert "max_logit" in merged.columns and pd.isna(merged["max_logit"].iloc[0])
    with pytest.raises(ValueError, match="lacks columns"):
        earlier.drop(columns="lr").to_csv(tmp_path / "bad.csv", index=False)
        write_sweep([tmp_path / "new"], tmp_path / "out", [tmp_path / "bad.csv"])
    with pytest.raises(FileNotFoundError, match="not found"):
        write_sweep([tmp_path / "new"], tmp_path / "out", [tmp_path / "missing.csv"])


def test_stability_map_finds_the_setting_keys_and_counts_outcomes(tmp_path):
    from stabilitylab.analysis.map import flatten, run_table, varying_keys, write_map

    n = 200
    for seed in (1, 2):
        for lr in (1e-3, 1e-1):
            base = tmp_path / f"lr{lr:g}_s{seed}"
            steps, loss, gn, _ = stable_curves(seed, n=n)
            done = {"status": "stable", "steps": int(steps[-1])}
            sig_loss = loss.copy()
            if lr == 1e-1 and seed == 1:  # a loss blow-up that the run-level rule did not flag
                sig_loss[150:] = 4 * loss[:5].mean()
            write_arm(base / "sigmoid", "sigmoid", steps, sig_loss, gn, lr=lr, seed=seed,
                      summary=done)  # fmt: skip
            sm = (
                {"status": "diverged", "divergence_step": 500, "steps": 500} if lr == 1e-1 else done
            )
            write_arm(base / "softmax", "softmax", steps, loss, gn, lr=lr, seed=seed, summary=sm)
    # Seeds, arms and names differ between the runs, but only the learning rate is a setting.
    assert varying_keys([{"train": {"lr": 1, "seed": 1}, "arm": "a", "name": "x"},
                         {"train": {"lr": 2, "seed": 2}, "arm": "b", "name": "y"}]) == ["train.lr"]  # fmt: skip
    assert flatten({"data": {"genes": [1, 2]}}) == {"data.genes": "[1, 2]"}
    runs, keys = run_table([tmp_path])
    assert keys == ["train.lr"]
    by = runs.set_index(["train.lr", "arm", "seed"])["outcome"]
    assert by[(1e-3, "softmax", 1)] == by[(1e-3, "sigmoid", 2)] == "stable"
    assert by[(1e-1, "softmax", 1)] == by[(1e-1, "softmax", 2)] == "diverged"
    assert by[(1e-1, "sigmoid", 1)] == "loss blow-up" and by[(1e-1, "sigmoid", 2)] == "stable"
    paths = write_map([tmp_path], tmp_path / "map")
    assert all(p.stat().st_size > 0 for p in paths.values())
    text = paths["map.md"].read_text()
    # S2 = lr 0.1: softmax 2 of 2 diverged at step 500; sigmoid 1 blow-up in 2 runs.
    assert "| S2 | 0/1/2 at " in text and "| 2/0/2 at 500,500 |" in text


def test_a_resumed_writer_purges_what_the_killed_run_logged_past_its_checkpoint(tmp_path):
    """A run killed at step 9 after its checkpoint at step 5 resumes with purge_step=5: the
    killed run's points 5-9 must not sit beside (or, for 8-9, outlive) the resumed run's."""
    from torch.utils.tensorboard import SummaryWriter

    from stabilitylab.analysis.events import load_arm

    first = SummaryWriter(str(tmp_path))
    for step in range(10):
        first.add_scalar("train/loss", 100.0 + step, step)
    first.close()
    time.sleep(1.1)  # event file names carry the second they were opened in
    resumed = SummaryWriter(str(tmp_path), purge_step=5)
    for step in range(5, 8):
        resumed.add_scalar("train/loss", 200.0 + step, step)
    resumed.close()
    df, cut = load_arm(tmp_path, "run", "arm")
    assert not cut
    assert df.step.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert df.value.tolist() == [100.0, 101.0, 102.0, 103.0, 104.0, 205.0, 206.0, 207.0]
