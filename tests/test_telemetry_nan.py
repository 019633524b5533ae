"""NaN is data: a head whose attention logits came out NaN reaches every aggregate of the max
logit (per layer, overall, the history behind summary.json, across processes, the report)."""

import json
import math

import numpy as np
import pandas as pd
import torch

from stabilitylab import runs, tags
from stabilitylab.analysis.early_warning import max_logit_series
from stabilitylab.analysis.events import COLUMNS, load_summary
from stabilitylab.analysis.stats import arm_row
from stabilitylab.telemetry import LogitMonitor, all_reduce_max_keep_nan, max_keep_nan
from stabilitylab.train.policy import History

NAN = math.nan


def test_a_nan_head_makes_its_layer_and_the_overall_max_nan():
    out = LogitMonitor.to_scalars([[1.0, NAN], [2.0, 3.0]])
    assert math.isnan(out[tags.layer(tags.MAX_LOGIT_LAYER, 0)])
    assert out[tags.layer(tags.MAX_LOGIT_LAYER, 1)] == 3.0
    assert math.isnan(out[tags.MAX_LOGIT])
    assert math.isnan(out[tags.head(0, 1)]) and out[tags.head(0, 0)] == 1.0


def test_max_keep_nan_wherever_the_nan_is():
    for values in ([NAN, 1.0], [1.0, NAN], [0.0, 2.0, NAN, 1.0]):
        assert math.isnan(max_keep_nan(values)), values
    assert max_keep_nan([1.0, math.inf]) == math.inf
    assert max_keep_nan(np.array([1.0, 4.0, 2.0], np.float32)) == 4.0


def test_the_history_and_summary_keep_a_nan_max_logit(tmp_path):
    hist = History()
    hist.append(0, 3.0, 1.0, [[1.0, 2.0]])
    assert hist.max_logit == 2.0
    hist.append(1, 3.0, 1.0, [[NAN, 1.0]])  # the loss may still be finite at that step
    hist.append(2, 3.0, 1.0, [[5.0, 1.0]])
    assert math.isnan(hist.max_logit), "a NaN step stays in the run's max"
    summary = runs.arm_summary(
        arm="sigmoid", backend="sigmoid-reference", status="stable", divergence=None, hist=hist,
        steps=3, interrupted=False, params=1, init_hash="x", peak_lr=1e-3, log_logits=True,
        peak_mem_gib=None,
    )  # fmt: skip
    runs.write_summary(tmp_path, **summary)
    assert json.loads((tmp_path / "summary.json").read_text())["max_logit"] == "nan"
    assert math.isnan(load_summary(tmp_path)["max_logit"])


def test_the_max_across_processes_keeps_a_nan_that_a_max_reduction_drops():
    rank0_LH = torch.tensor([[1.0, NAN], [2.0, 3.0]])
    rank1_LH = torch.tensor([[4.0, 1.0], [1.0, NAN]])

    def encoded(x):  # what the other process puts into the collective
        return torch.stack([torch.where(x.isnan(), -math.inf, x), x.isnan().float()])

    def fmax_reduce(other):  # a MAX collective that skips NaN, as torch.fmax does
        return lambda t: t.copy_(torch.fmax(t, encoded(other)))

    out0 = all_reduce_max_keep_nan(rank0_LH, fmax_reduce(rank1_LH))
    out1 = all_reduce_max_keep_nan(rank1_LH, fmax_reduce(rank0_LH))
    want = torch.tensor([[4.0, NAN], [2.0, NAN]])
    torch.testing.assert_close(out0, want, equal_nan=True)
    torch.testing.assert_close(out1, want, equal_nan=True)


def _logit_frame(per_layer: dict[int, list[float]], with_overall: bool) -> pd.DataFrame:
    steps = range(len(per_layer[0]))
    rows = [("r", "a", s, tags.LOSS, 3.0) for s in steps]
    rows += [("r", "a", s, tags.GRAD_NORM, 1.0) for s in steps]
    for i, values in per_layer.items():
        rows += [("r", "a", s, tags.layer(tags.MAX_LOGIT_LAYER, i), values[s]) for s in steps]
    if with_overall:
        overall = [max_keep_nan([v[s] for v in per_layer.values()]) for s in steps]
        rows += [("r", "a", s, tags.MAX_LOGIT, overall[s]) for s in steps]
    return pd.DataFrame(rows, columns=COLUMNS)


def test_the_report_keeps_a_nan_max_logit():
    per_layer = {0: [1.0, 2.0, 1.5, 2.5], 1: [1.0, NAN, 1.0, 1.0]}
    for with_overall in (True, False):  # the logged overall tag, or the max of the layers'
        df = _logit_frame(per_layer, with_overall)
        _, values, _ = max_logit_series(df)
        assert math.isnan(values[1]) and values[3] == 2.5
        row, _ = arm_row(df, {"status": "stable", "divergence_step": None})
        assert math.isnan(row["max_logit"]), with_overall
