"""The run-identity check: equal values (NaN too), step and tag mismatches reported, timing tags
aside; two deterministic smoke runs of one seed bit-identical on every tag, another seed not;
bad paths exit 2."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from stabilitylab import tags
from stabilitylab.analysis import identity as I
from stabilitylab.cli import train_main

SMOKE = [
    "--preset", "smoke", "--report=False", "--train.steps=4", "--train.deterministic=True",
    "--telemetry.log_every=1", "--telemetry.layer_every=1", "--telemetry.logit_every=1",
    "--telemetry.probe_every=2",
]  # fmt: skip


def tidy(values: dict[str, list], steps=None) -> pd.DataFrame:
    """A one-arm tidy frame: ``{tag: values}`` at steps 0, 1, ... (or ``steps``)."""
    rows = [
        (tag, s, v)
        for tag, vs in values.items()
        for s, v in zip(steps or range(len(vs)), vs, strict=True)
    ]
    return pd.DataFrame(rows, columns=["tag", "step", "value"])


# ---- pure functions ----------------------------------------------------------------------------


def test_nan_equals_nan_and_other_non_finite_mismatches_are_infinite():
    nan, inf = math.nan, math.inf
    a = np.array([1.0, nan, inf, -inf, 2.0, nan, inf])
    b = np.array([1.0, nan, inf, -inf, 2.5, 3.0, -inf])
    np.testing.assert_array_equal(I.abs_differences(a, b), [0, 0, 0, 0, 0.5, inf, inf])
    row = I.compare_series([0, 1, 2], [1.0, nan, inf], [0, 1, 2], [1.0, nan, inf])
    assert row["status"] == I.IDENTICAL and row["max_abs_diff"] == 0 and row["n_common"] == 3


def test_differences_and_step_mismatches_are_reported():
    row = I.compare_series([0, 1, 2], [1.0, 2.0, 3.0], [0, 1, 2], [1.0, 2.0, 3.0 + 1e-6])
    assert row["status"] == "values differ" and row["first_diff_step"] == 2
    assert row["n_differ"] == 1 and row["max_abs_diff"] == pytest.approx(1e-6)
    # B stopped a step early: the common steps agree, but the curves are not the same
    row = I.compare_series([0, 1, 2], [1.0, 2.0, 3.0], [0, 1], [1.0, 2.0])
    assert (row["status"], row["n_steps_a"], row["n_steps_b"], row["n_common"]) == (
        "steps differ", 3, 2, 2,
    )  # fmt: skip
    assert row["max_abs_diff"] == 0


def test_tags_in_one_run_only_and_timing_tags_are_rows_and_verdicts_follow():
    a = tidy({tags.LOSS: [3.0, 2.0], tags.STEP_TIME: [0.1, 0.1], tags.LR: [1e-3, 1e-3]})
    b = tidy({tags.LOSS: [3.0, 2.0], tags.STEP_TIME: [0.2, 0.3], tags.GRAD_NORM: [1.0, 1.0]})
    table = I.compare_arm("softmax", a, b)
    status = dict(zip(table["tag"], table["status"], strict=True))
    assert status == {
        tags.LOSS: I.IDENTICAL, tags.STEP_TIME: I.TIMING, tags.LR: "only in A",
        tags.GRAD_NORM: "only in B",
    }  # fmt: skip
    assert table.set_index("tag").loc[tags.STEP_TIME, "max_abs_diff"] == pytest.approx(0.2)
    assert I.verdict(table) == I.NOT_IDENTICAL
    same = I.compare_arm(
        "softmax", a, a.assign(value=np.where(a.tag == tags.STEP_TIME, 9, a.value))
    )
    assert I.verdict(same) == I.BIT_IDENTICAL  # timing tags do not count
    assert I.verdict(same[same["status"] == I.TIMING]) == I.NOT_IDENTICAL  # nothing judged


def test_config_differences_leave_out_bookkeeping():
    a = {"name": "a", "out_dir": "x", "train": {"seed": 1, "lr": 1e-3}}
    b = {"name": "b", "out_dir": "y", "train": {"seed": 2, "lr": 1e-3}}
    assert I.config_differences(a, b) == ["train.seed: 1 -> 2"]
    assert I.config_differences(a, None) == ["config.json: present in one run only"]


# ---- smoke runs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """Paired smoke runs, 4 steps, deterministic, every tag logged every step: ``a`` and ``b``
    of one seed, ``c`` of another. Run dirs by name."""
    root = tmp_path_factory.mktemp("identity")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, seed in (("a", 42), ("b", 42), ("c", 7)):
            argv = [*SMOKE, f"--out_dir={root}", f"--name={name}", f"--train.seed={seed}"]
            assert train_main(argv) == 0
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(False)  # train.deterministic set it for the process
    return {name: root / name for name in "abc"}


def test_same_seed_deterministic_runs_are_bit_identical_on_every_tag(smoke_runs):
    table, configs = I.compare_runs(smoke_runs["a"], smoke_runs["b"])
    assert I.verdict(table) == I.BIT_IDENTICAL
    assert set(table["arm"]) == {"softmax", "sigmoid"}
    judged = I.judged(table)
    assert (judged["status"] == I.IDENTICAL).all() and (judged["max_abs_diff"] == 0).all()
    for arm in ("softmax", "sigmoid"):
        arm_tags = set(judged[judged["arm"] == arm]["tag"])
        assert {tags.LOSS, tags.GRAD_NORM, tags.MAX_LOGIT, tags.layer(tags.JACOBIAN_LAYER, 0),
                "summary/final_loss"} <= arm_tags  # fmt: skip
        loss = judged[(judged["arm"] == arm) & (judged["tag"] == tags.LOSS)].iloc[0]
        assert loss["n_common"] == 4
    assert configs == {"softmax": [], "sigmoid": []}


def test_another_seed_is_not_identical_and_says_why(smoke_runs, tmp_path):
    table, configs = I.compare_runs(smoke_runs["a"], smoke_runs["c"])
    assert I.verdict(table) == I.NOT_IDENTICAL
    loss = table[table["tag"] == tags.LOSS]
    assert (loss["status"] == "values differ").all() and (loss["max_abs_diff"] > 0).all()
    assert configs["softmax"] == ["train.seed: 42 -> 7"]
    # one arm against a paired run: the other arm is reported, not dropped
    paths = I.write_identity(smoke_runs["a"] / "softmax", smoke_runs["b"], tmp_path / "one")
    csv = pd.read_csv(paths["identity.csv"])
    assert set(csv[csv["tag"] == "-"]["status"]) == {"arm only in B"}
    assert "# Run identity: not identical" in paths["identity.md"].read_text()


def test_cli_writes_markdown_and_csv_and_exits_0_either_way(smoke_runs, tmp_path, capsys):
    assert I.main([str(smoke_runs["a"]), str(smoke_runs["b"]), "--out", str(tmp_path / "s")]) == 0
    assert "# Run identity: bit-identical" in capsys.readouterr().out
    assert I.main([str(smoke_runs["a"]), str(smoke_runs["c"]), "--out", str(tmp_path / "d")]) == 0
    assert "# Run identity: not identical" in (tmp_path / "d" / "identity.md").read_text()
    assert len(pd.read_csv(tmp_path / "d" / "identity.csv")) > 10


def test_cli_exits_2_for_a_missing_dir_or_one_without_events(smoke_runs, tmp_path, capsys):
    assert I.main([str(smoke_runs["a"]), str(tmp_path / "nowhere")]) == 2
    assert "error: run directory not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert I.main([str(tmp_path / "empty"), str(smoke_runs["a"])]) == 2
    err = capsys.readouterr().err
    assert "error: no TensorBoard event files" in err and "empty" in err
