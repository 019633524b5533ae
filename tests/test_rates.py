"""Outcome rates over repeated runs: Wilson intervals, grouping of repeats, the rates and
early-warning tables, the false-alarm filter, and experiments/sweep.py --repeats."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from stabilitylab.analysis.rates import (
    FALSE_ALARM_MAX,
    filter_first_warnings,
    has_repeats,
    outcome_rates,
    run_groups,
    warning_rates,
    wilson_interval,
)
from tests.test_analysis import EVERY, diverging_curves, stable_curves, write_arm

REPO = Path(__file__).resolve().parent.parent

# ---- Wilson interval ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "n", "low", "high"),
    [  # 95% score intervals, z = 1.96; the last four are Newcombe (1998), Table I, method 3
        (0, 10, 0.0, 0.2775),
        (5, 10, 0.2366, 0.7634),
        (10, 10, 0.7225, 1.0),
        (81, 263, 0.2553, 0.3662),
        (15, 148, 0.0624, 0.1605),
        (0, 20, 0.0, 0.1611),
        (1, 29, 0.0061, 0.1718),
    ],
)
def test_wilson_interval_known_values(k, n, low, high):
    got = wilson_interval(k, n)
    assert got == pytest.approx((low, high), abs=5e-5)
    assert got[0] <= k / n <= got[1]


def test_wilson_interval_matches_scipy_and_is_symmetric():
    stats = pytest.importorskip("scipy.stats")
    z = float(stats.norm.ppf(0.975))
    for n in (1, 2, 7, 30):
        for k in range(n + 1):
            ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
            assert wilson_interval(k, n, z) == pytest.approx((ci.low, ci.high), abs=1e-12)
            low, high = wilson_interval(k, n)
            mirror = wilson_interval(n - k, n)
            assert (low, high) == pytest.approx((1 - mirror[1], 1 - mirror[0]), abs=1e-12)
    # A wider z, a wider interval; more runs, a narrower one.
    assert wilson_interval(3, 10, z=2.58)[0] < wilson_interval(3, 10)[0]
    assert wilson_interval(30, 100)[1] - wilson_interval(30, 100)[0] < 0.2


@pytest.mark.parametrize(
    ("k", "n", "z", "match"),
    [(0, 0, 1.96, "n must be >= 1"), (4, 3, 1.96, r"k must be in \[0, n\]"),
     (-1, 3, 1.96, "k must be in"), (1.5, 3, 1.96, "k must be an integer"),
     (1, 3, 0.0, "z must be positive"), (True, 3, 1.96, "k must be an integer")],
)  # fmt: skip
def test_wilson_interval_rejects_bad_counts(k, n, z, match):
    with pytest.raises(ValueError, match=match):
        wilson_interval(k, n, z)


# ---- grouping ----------------------------------------------------------------------------------


def _config_dir(d: Path, arm: str, *, lr: float = 0.1, seed: int = 1) -> Path:
    d.mkdir(parents=True)
    config = {"arm": arm, "backend": arm, "name": d.parent.name, "out_dir": "runs",
              "model": {"qk_layernorm": False}, "train": {"lr": lr, "seed": seed}}  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_repeats_group_by_arm_and_setting_not_by_name_or_seed(tmp_path):
    found = []
    for run, arm, lr, seed in [("a_s1", "softmax", 0.1, 1), ("a_s2", "softmax", 0.1, 2),
                               ("b_s1_r1", "softmax", 0.1, 1), ("a_s1", "sigmoid", 0.1, 1),
                               ("c_s1", "softmax", 0.01, 1)]:  # fmt: skip
        found.append((_config_dir(tmp_path / run / arm, arm, lr=lr, seed=seed), run, arm))
    bare = tmp_path / "old" / "softmax"
    bare.mkdir(parents=True)
    (bare / "summary.json").write_text(json.dumps({"status": "stable"}))
    found.append((bare, "old", "softmax"))

    groups, settings = run_groups(found)
    assert groups == {
        ("a_s1", "softmax"): "softmax S1", ("a_s2", "softmax"): "softmax S1",
        ("b_s1_r1", "softmax"): "softmax S1", ("a_s1", "sigmoid"): "sigmoid S1",
        ("c_s1", "softmax"): "softmax S2", ("old", "softmax"): "old/softmax",
    }  # fmt: skip
    assert settings.to_dict("records") == [
        {"setting": "S1", "train.lr": 0.1},
        {"setting": "S2", "train.lr": 0.01},
    ]
    assert has_repeats(groups)

    # One paired run: one setting, the group is the arm, and nothing is repeated.
    pair = [(found[0][0], "a_s1", "softmax"), (found[3][0], "a_s1", "sigmoid")]
    groups, settings = run_groups(pair)
    assert groups == {("a_s1", "softmax"): "softmax", ("a_s1", "sigmoid"): "sigmoid"}
    assert list(settings.columns) == ["setting"] and not has_repeats(groups)


# ---- tables ------------------------------------------------------------------------------------


def _summary(rows) -> pd.DataFrame:
    """Per-run table as the report builds it: (run, status, divergence step, first warning)."""
    df = pd.DataFrame(rows, columns=["run", "status", "divergence_step", "first_warning"])
    df.insert(1, "arm", "softmax")
    return df.assign(lead_steps=pd.array([None] * len(df), dtype="Int64")).astype(
        {"divergence_step": "Int64"}
    )


def test_outcome_rates_three_of_five_diverged():
    summary = _summary(
        [("r1", "diverged", 300, "grad_ratio"), ("r2", "diverged", 700, "logit"),
         ("r3", "diverged", 500, "grad_ratio"), ("r4", "stable", None, None),
         ("r5", "stable", None, None), ("r6", "interrupted", None, None)]
    )  # fmt: skip
    groups = {(r, "softmax"): "softmax" for r in summary["run"]}
    (row,) = outcome_rates(summary, groups).to_dict("records")
    assert (row["n_runs"], row["n_diverged"], row["n_unfinished"]) == (5, 3, 1)
    assert row["fraction_diverged"] == pytest.approx(0.6)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson_interval(3, 5))
    assert row["median_divergence_step"] == 500.0
    assert (row["min_divergence_step"], row["max_divergence_step"]) == (300, 700)
    assert row["first_warning"] == "grad_ratio (2 of 3)"

    # No finished run: no rate, no interval, and no crash.
    none = outcome_rates(summary.iloc[[5]], groups).iloc[0]
    assert none["n_runs"] == 0 and math.isnan(none["ci_low"]) and none["n_unfinished"] == 1


def _early(fired: dict[str, dict[str, int | None]], divergence: dict[str, int | None]):
    """Early-warning rows: ``fired[precursor][run]`` = step it fired at (None: never)."""
    rows = []
    for precursor, by_run in fired.items():
        for run, step in by_run.items():
            div = divergence[run]
            lead = div - step if step is not None and div is not None else None
            rows.append(("softmax" if run.startswith("s") else "sigmoid", run, precursor, step,
                         div, lead))  # fmt: skip
    df = pd.DataFrame(
        rows, columns=["arm", "run", "precursor", "step", "divergence_step", "lead_steps"]
    )
    return df.astype({"step": "Int64", "divergence_step": "Int64", "lead_steps": "Int64"})


def test_a_precursor_that_fires_on_stable_runs_is_not_named_first_warning():
    # softmax: s1-s3 diverged at 500, s4-s6 stable. "noisy" fires early on every run
    # (so it would lead by 400) and on 2 of the 3 stable ones; "clean" warns by 100 and
    # never fires on a stable run.
    div = {"s1": 500, "s2": 500, "s3": 500, "s4": None, "s5": None, "s6": None}
    early = _early(
        {"noisy": {"s1": 100, "s2": 100, "s3": 100, "s4": 100, "s5": 120, "s6": None},
         "clean": {"s1": 400, "s2": 400, "s3": 450, "s4": None, "s5": None, "s6": None}},
        div,
    )  # fmt: skip
    summary = _summary([(r, "diverged" if d else "stable", d, None) for r, d in div.items()])
    groups = {(r, "softmax"): "softmax" for r in div}

    warn = warning_rates(early, summary, groups).set_index("precursor")
    assert warn.loc["noisy", "n_false_alarm"] == 2 and warn.loc["noisy", "n_stable"] == 3
    assert warn.loc["noisy", "false_alarm_rate"] == pytest.approx(2 / 3)
    assert FALSE_ALARM_MAX < 2 / 3
    assert warn.loc["noisy", "fa_ci_low"] == pytest.approx(wilson_interval(2, 3)[0])
    assert not warn.loc["noisy", "named"] and warn.loc["clean", "named"]
    assert warn.loc["clean", "false_alarm_rate"] == 0 and warn.loc["clean", "n_warned"] == 3
    assert warn.loc["clean", "median_lead"] == 100 and warn.loc["clean", "min_lead"] == 50
    assert (warn["false_alarm_basis"] == "arm").all()

    filtered = filter_first_warnings(summary, early, groups, warning_rates(early, summary, groups))
    diverged = filtered[filtered["status"] == "diverged"]
    assert list(diverged["first_warning"]) == ["clean"] * 3
    assert list(diverged["lead_steps"]) == [100, 100, 50]
    assert filtered[filtered["status"] == "stable"]["first_warning"].isna().all()
    assert outcome_rates(filtered, groups).iloc[0]["first_warning"] == "clean (3 of 3)"

    # The limit is a bound on the rate: 2 of 3 passes a limit of 2/3, not one just below.
    by = lambda t: warning_rates(early, summary, groups, threshold=t).set_index("precursor")
    assert by(2 / 3).loc["noisy", "named"] and not by(2 / 3 - 1e-9).loc["noisy", "named"]


def test_one_false_alarm_in_five_stable_runs_is_at_the_limit_and_still_named():
    div = {f"s{i}": None for i in range(5)}
    early = _early({"edge": {r: (100 if r == "s0" else None) for r in div}}, div)
    summary = _summary([(r, "stable", None, None) for r in div])
    warn = warning_rates(early, summary, {(r, "softmax"): "softmax" for r in div}).iloc[0]
    assert warn["false_alarm_rate"] == pytest.approx(FALSE_ALARM_MAX) and warn["named"]


def test_a_group_without_stable_runs_is_judged_on_the_reports_stable_runs():
    # softmax (s1, s2) always diverged; sigmoid (g1, g2) never did. "noisy" fires on both
    # sigmoid runs, "quiet" on none; "lonely" has data on the softmax runs only.
    div = {"s1": 300, "s2": 400, "g1": None, "g2": None}
    early = _early(
        {"noisy": {"s1": 50, "s2": 50, "g1": 50, "g2": 60},
         "quiet": {"s1": 250, "s2": 390, "g1": None, "g2": None},
         "lonely": {"s1": 200, "s2": 300}},
        div,
    )  # fmt: skip
    summary = pd.DataFrame(
        {"run": list(div), "arm": ["softmax", "softmax", "sigmoid", "sigmoid"],
         "status": ["diverged", "diverged", "stable", "stable"],
         "divergence_step": pd.array(list(div.values()), dtype="Int64"),
         "first_warning": None, "lead_steps": pd.array([None] * 4, dtype="Int64")}
    )  # fmt: skip
    groups = {(r, a): a for r, a in zip(summary["run"], summary["arm"], strict=True)}
    warn = warning_rates(early, summary, groups).set_index(["group", "precursor"])
    soft = warn.loc["softmax"]
    assert soft.loc["noisy", "false_alarm_basis"] == "all stable runs"
    assert soft.loc["noisy", "n_false_alarm"] == 2 and not soft.loc["noisy", "named"]
    assert soft.loc["quiet", "named"] and soft.loc["quiet", "n_stable"] == 2
    assert soft.loc["lonely", "false_alarm_basis"] == "-" and soft.loc["lonely", "named"]
    assert warn.loc[("sigmoid", "noisy"), "false_alarm_basis"] == "arm"
    filtered = filter_first_warnings(summary, early, groups, warning_rates(early, summary, groups))
    assert list(filtered["first_warning"].iloc[:2]) == ["lonely", "lonely"]


# ---- the report over repeats -------------------------------------------------------------------


def test_report_over_repeats_writes_rates_and_skips_noisy_precursors(tmp_path):
    from stabilitylab.analysis.report import RATE_FILES, REPORT_FILES, write_report

    n = 60
    for seed in range(5):
        if seed < 3:
            at = 40 + 2 * seed
            steps, loss, gn, logit = diverging_curves(seed, at, n=n)
            summary = {"status": "diverged", "divergence_step": int(steps[at])}
        else:  # stable, but with a logit jump that trips logit_runaway: a false alarm
            steps, loss, gn, logit = stable_curves(seed, n=n)
            logit[20:] *= 10
            summary = {"status": "stable"}
        write_arm(tmp_path / f"rep_s{seed}" / "softmax", "softmax", steps, loss, gn, logit,
                  layers=1, heads=1, seed=seed, summary=summary)  # fmt: skip

    paths = write_report([tmp_path], tmp_path / "out")
    assert set(paths) == {*REPORT_FILES, *RATE_FILES}
    (row,) = pd.read_csv(paths["rates.csv"]).to_dict("records")
    assert (row["group"], row["n_runs"], row["n_diverged"]) == ("softmax", 5, 3)
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson_interval(3, 5))
    assert row["median_divergence_step"] == 42 * EVERY

    warn = pd.read_csv(paths["warning_rates.csv"]).set_index("precursor")
    runaway = warn.loc["logit_runaway/layer_0"]
    assert (runaway["n_warned"], runaway["n_false_alarm"], runaway["n_stable"]) == (3, 2, 2)
    assert not runaway["named"] and runaway["min_lead"] > 0

    # Unfiltered, logit_runaway leads every divergence; the report names another precursor.
    early = pd.read_csv(paths["early_warning.csv"])
    assert (early[early["precursor"] == "logit_runaway/layer_0"]["lead_steps"].dropna() > 0).all()
    per_run = pd.read_csv(paths["summary.csv"])
    assert list(per_run.columns[:3]) == ["run", "arm", "group"]
    named = per_run[per_run["status"] == "diverged"]["first_warning"]
    assert named.notna().all() and not named.str.startswith("logit_runaway").any()
    text = paths["report.md"].read_text()
    assert "## Outcome rates over repeats" in text and "## Early warning over repeats" in text
    assert paths["groups.png"].read_bytes()[:4] == b"\x89PNG" and "(groups.png)" in text
    assert "no finite data" not in text  # every panel of both figures had its tag
    assert (
        "- `logit_runaway/layer_0` for `softmax`: fired on 2 of 2 stable runs of this group, "
        "100% > 20%" in text
    )


def test_a_single_draw_report_has_no_rates(tmp_path):
    from stabilitylab.analysis.report import repeat_tables

    found = [(_config_dir(tmp_path / "pair" / a, a), "pair", a) for a in ("softmax", "sigmoid")]
    assert repeat_tables(found, pd.DataFrame(), pd.DataFrame()) is None


# ---- experiments/sweep.py --repeats ------------------------------------------------------------


@pytest.fixture(scope="module")
def sweep_script():
    spec = importlib.util.spec_from_file_location("sweep_script", REPO / "experiments/sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _jobs(sweep_script, *argv):
    args = sweep_script.parse_args(["--name", "rep", "--lr", "0.1", "--arms", "softmax", *argv])
    return [(label, dict(a.split("=", 1) for a in run if "=" in a))
            for label, run in sweep_script.grid(args)]  # fmt: skip


def test_sweep_repeats_give_distinct_seeds_and_run_dirs(sweep_script):
    jobs = _jobs(sweep_script, "--seeds", "1", "10", "--repeats", "3", "--", "--train.steps=5")
    assert [j[1]["--train.seed"] for j in jobs] == ["1", "2", "3", "10", "11", "12"]
    names = [j[1]["--name"] for j in jobs]
    assert len(set(names)) == 6 and names[0] == "rep__lr0.1_qk0_s1"
    assert all(j[1]["--train.steps"] == "5" for j in jobs)

    same = _jobs(sweep_script, "--seeds", "7", "--repeats", "4", "--same_seed")
    assert {j[1]["--train.seed"] for j in same} == {"7"}
    assert [j[1]["--name"] for j in same] == [f"rep__lr0.1_qk0_s7_r{k}" for k in range(4)]
    assert len(_jobs(sweep_script)) == 1  # default: one run per grid point, as before


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--repeats", "0"], "--repeats: must be a positive integer, got 0"),
     (["--repeats", "-2"], "--repeats: must be a positive integer, got -2"),
     (["--seeds", "1", "2", "--repeats", "3"], r"seed\(s\) \[2, 3\] more than once"),
     (["--same_seed"], "--same_seed needs --repeats")],
)  # fmt: skip
def test_sweep_refuses_bad_repeats(sweep_script, capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        sweep_script.parse_args(["--name", "rep", "--lr", "0.1", *argv])
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)


def test_the_groups_figure_says_which_panel_had_no_data(tmp_path):
    """A group figure over runs without the all-layer max-logit tag draws the other panels and
    returns a note naming the missing tag (the report prints it)."""
    from stabilitylab import tags
    from stabilitylab.analysis import plots

    steps = np.arange(4)
    df = pd.DataFrame(
        [{"run": f"r{s}", "arm": "softmax", "step": int(t), "tag": tag, "value": 1.0 + t}
         for s in range(2) for t in steps for tag in (tags.LOSS, tags.GRAD_NORM)]
    )  # fmt: skip
    groups = {("r0", "softmax"): "softmax", ("r1", "softmax"): "softmax"}
    notes = plots.groups_figure(df, groups, {("r0", "softmax"): 2}, tmp_path / "g.png")
    assert notes == [f"no finite data for {tags.MAX_LOGIT}: panel 'max attention logit (all "
                     "layers)' skipped"]  # fmt: skip
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
