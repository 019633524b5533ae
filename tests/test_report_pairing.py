"""What report.md says first: its headline (what ran, what held), and whether the arms of a run
can be paired. ``--fresh=True --arm X`` restarts one arm; when that leaves the arms of one run with
different configs, the report says so (report.md's "Arms that differ" and an
``ArmsDifferWarning``) instead of pairing them silently."""

import warnings

import pandas as pd
import pytest

from stabilitylab import config as C
from stabilitylab.analysis.events import load_config
from stabilitylab.analysis.report import ArmsDifferWarning, headline, write_report
from stabilitylab.analysis.settings import arm_differences
from stabilitylab.train import run
from tests.test_analysis import diverging_curves, stable_curves, write_arm
from tests.tiny_runs import TINY

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_report_names_the_keys_in_which_a_runs_arms_differ(tmp_path):
    steps, loss, gn, logit = stable_curves(0, n=30)
    write_arm(tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit, lr=1e-3)
    write_arm(tmp_path / "pair" / "sigmoid", "sigmoid", steps, loss, gn, logit, lr=3e-3)
    with pytest.warns(ArmsDifferWarning, match=r"train\.lr: sigmoid 0\.003, softmax 0\.001"):
        paths = write_report([tmp_path / "pair"])
    section = paths["report.md"].read_text().split("## Arms that differ")[1].split("\n## ")[0]
    assert f"`{tmp_path / 'pair'}`" in section and "train.lr" in section
    assert "train.seed" not in section, "only the keys that differ"


def test_arms_of_different_runs_may_differ_without_a_word(tmp_path):
    steps, loss, gn, logit = stable_curves(0, n=30)
    write_arm(tmp_path / "a" / "softmax", "softmax", steps, loss, gn, logit, lr=1e-3)
    write_arm(tmp_path / "b" / "softmax", "softmax", steps, loss, gn, logit, lr=3e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = write_report([tmp_path / "a", tmp_path / "b"])
    assert "Arms that differ" not in paths["report.md"].read_text()


def test_a_fresh_restart_of_one_arm_with_other_values_is_flagged(tmp_path):
    def cfg(*extra):
        args = ["--preset", "smoke", f"--out_dir={tmp_path}", *TINY, "--train.steps=1", *extra]
        return C.parse(args)

    def differences():
        return arm_differences({a: load_config(tmp_path / "smoke" / a) for a in C.ARMS})

    run(cfg())
    assert differences() == {}, "the arms of one command differ only in the arm"
    run(cfg("--arm=sigmoid", "--fresh=True", "--train.lr=0.01"))
    assert differences() == {"train.lr": {"softmax": 0.003, "sigmoid": 0.01}}


def test_the_report_opens_with_what_ran_and_what_held(tmp_path):
    n, at = 120, 80
    steps, loss, gn, logit = diverging_curves(0, at, n=n)
    diverged = {"status": "diverged", "divergence_step": int(steps[at])}
    write_arm(tmp_path / "pair" / "softmax", "softmax", steps, loss, gn, logit, summary=diverged)
    s_steps, s_loss, s_gn, _ = stable_curves(1, n=n)
    write_arm(tmp_path / "pair" / "sigmoid", "sigmoid", s_steps, s_loss, s_gn, summary={"status": "stable", "steps": 1200})  # fmt: skip
    lines = write_report([tmp_path / "pair"])["report.md"].read_text().splitlines()
    assert lines[2] == "**Ran:** 2 arms of 1 run (`pair`), 1200 steps."  # softmax has no steps
    assert (
        lines[4]
        == f"**Held:** sigmoid stable; softmax diverged at step {steps[at]} (logit growth)."
    )


def test_a_headline_over_many_arms_counts_outcomes_per_arm():
    summary = pd.DataFrame(
        {
            "run": [f"r{i}" for i in range(6)],
            "arm": ["softmax", "sigmoid"] * 3,
            "status": ["diverged", "stable", "stable", "stable", "diverged", "stable"],
            "divergence_step": pd.array([5, None, None, None, 9, None], dtype="Int64"),
            "mechanism": ["other", None, None, None, "logit growth", None],
            "last_step": pd.array([5, 99, 99, 99, 9, 99], dtype="Int64"),
        }
    )
    ran, held = headline(summary)
    assert ran == "**Ran:** 6 arms of 6 runs (`r0`, `r1`, `r2`, ...), logged to step 5-99."
    assert headline(summary, [6, 100, 100, 100, 10, 100])[0].endswith("6-100 steps.")
    assert headline(summary.iloc[1:2], [100])[0] == "**Ran:** 1 arm of 1 run (`r1`), 100 steps."
    assert held == "**Held:** softmax: 2 diverged, 1 stable; sigmoid: 3 stable."


def test_a_headline_over_many_distinct_arms_names_those_that_did_not_hold():
    cells = ["sm-rope", "sig-rope", "sm-nope", "sig-nope", "sm-g-rope"]
    summary = pd.DataFrame(
        {
            "run": ["kv"] * 5,
            "arm": cells,
            "status": ["stable", "diverged", "stable", "stable", "stable"],
            "divergence_step": pd.array([None, 40, None, None, None], dtype="Int64"),
            "mechanism": [None, "early transient", None, None, None],
            "last_step": pd.array([149, 40, 149, 149, 149], dtype="Int64"),
        }
    )
    _, held = headline(summary, [150, 41, 150, 150, 150])
    assert held == "**Held:** 4 stable, 1 diverged: sig-rope diverged at step 40 (early transient)."
