"""The speed tools: analysis/step_speed.py (medians of the timing tags per run and arm) and
experiments/bench/bench_clocks.py (its nvidia-smi reading)."""

import json
import math

import pandas as pd
import pytest
from torch.utils.tensorboard import SummaryWriter

from stabilitylab import tags
from stabilitylab.analysis.step_speed import main, paired_ratios, speed_table, stall_table


def _rows(run, arm, tag, values, start=0, every=10):
    return [(run, arm, start + i * every, tag, v) for i, v in enumerate(values)]


def test_speed_table_takes_medians_from_the_step_on():
    rows = [
        *_rows("eager", "sig", tags.STEP_TIME, [9.0, 0.2, 0.1, 0.3, 0.2]),
        *_rows("eager", "sig", tags.MFU, [0.01, 0.2, 0.3, 0.1, 0.2]),
        *_rows("eager", "sig", "train/loss", [5.0, 4.0, 3.0, 2.0, 1.0]),
        *_rows("fast", "sig", tags.STEP_TIME, [60.0, 0.05, 0.07]),
    ]
    df = pd.DataFrame(rows, columns=["run", "arm", "step", "tag", "value"])
    t = speed_table(df, from_step=10).set_index("run")
    assert t.loc["eager", "steps"] == 4 and t.loc["eager", "step_s"] == pytest.approx(0.2)
    assert t.loc["eager", "mfu"] == pytest.approx(0.2)
    assert t.loc["fast", "steps"] == 2 and t.loc["fast", "step_s"] == pytest.approx(0.06)
    assert math.isnan(t.loc["fast", "mfu"]) and math.isnan(t.loc["eager", "peak_mem_GiB"])
    assert speed_table(df, from_step=0).set_index("run").loc["fast", "step_s"] == 0.07
    with pytest.raises(ValueError, match="step >= 50"):
        speed_table(df, from_step=50)


def test_paired_ratios_take_the_median_over_shared_steps():
    """A recompile in one run moves one ratio, not the verdict: b is 2% faster step for step
    although its median from step 10 is higher; c shares two steps with a."""
    rows = [
        *_rows("a", "sig", tags.STEP_TIME, [9.0, 6.0, 0.50, 0.60, 0.70, 0.55]),
        *_rows("b", "sig", tags.STEP_TIME, [9.0, 1.5, 0.96, 0.588, 0.686, 0.539]),
        *_rows("c", "sig", tags.STEP_TIME, [1.0, 1.2], start=20),
    ]
    df = pd.DataFrame(rows, columns=["run", "arm", "step", "tag", "value"])
    medians = speed_table(df, from_step=10).set_index("run")["step_s"]
    assert medians["b"] > medians["a"]
    ratios = paired_ratios(df, from_step=10, baseline=("a", "sig"))
    assert ratios[("a", "sig")] == 1.0
    assert ratios[("b", "sig")] == pytest.approx(0.98)
    assert ratios[("c", "sig")] == pytest.approx((2.0 + 2.0) / 2)
    with pytest.raises(ValueError, match="baseline z/sig logged no step time here"):
        paired_ratios(df, from_step=10, baseline=("z", "sig"))


def test_stall_table_counts_steps_far_over_the_median_and_their_excess():
    """A recompile at step 30 of one arm: one stall, its seconds beyond the median; a step 2.5x
    the median is slow but no stall; an arm whose stall lies before from_step has none."""
    rows = [
        *_rows("r", "sig", tags.STEP_TIME, [60.0, 0.6, 0.5, 23.1, 0.55, 1.5, 0.62]),
        *_rows("r", "soft", tags.STEP_TIME, [90.0, 0.8, 0.9, 0.7]),
    ]
    df = pd.DataFrame(rows, columns=["run", "arm", "step", "tag", "value"])
    t = stall_table(df, from_step=10)
    assert t.loc[("r", "sig"), "stalls"] == 1
    assert t.loc[("r", "sig"), "stall_s"] == pytest.approx(23.1 - 0.61)
    assert t.loc[("r", "soft"), "stalls"] == 0 and t.loc[("r", "soft"), "stall_s"] == 0.0
    assert stall_table(df, from_step=0).loc[("r", "soft"), "stalls"] == 1
    assert stall_table(df, from_step=10, factor=2.0).loc[("r", "sig"), "stalls"] == 2


def test_step_speed_reads_run_dirs_end_to_end(tmp_path, capsys):
    """Event files as the trainer writes them, summary.json's wall time, the tables written."""
    for run, step_s in (("eager", 0.1), ("fast", 0.05)):
        arm_dir = tmp_path / run / "sigmoid"
        w = SummaryWriter(str(arm_dir))
        for step in range(0, 100, 10):
            w.add_scalar(tags.STEP_TIME, 30.0 if step == 0 else step_s, step)
        w.close()
        (arm_dir / "summary.json").write_text(json.dumps({"arm": "sigmoid", "wall_time_s": 12.5}))
    out = tmp_path / "speed"
    assert main([str(tmp_path / "eager"), str(tmp_path / "fast"), "--from-step", "10",
                 "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "| eager | sigmoid | 9 | 0.1 |" in printed and "| fast | sigmoid | 9 | 0.05 |" in printed
    table = pd.read_csv(out / "step_speed.csv")
    assert list(table["wall_s"]) == [12.5, 12.5]
    assert list(table["paired"]) == [1.0, 0.5]
    assert list(table["stalls"]) == [0, 0] and list(table["stall_s"]) == [0.0, 0.0]
    assert main([str(tmp_path / "eager"), "--from-step", "0", "--out", str(out)]) == 0
    eager = pd.read_csv(out / "step_speed.csv").iloc[0]
    assert eager["stalls"] == 1 and eager["stall_s"] == pytest.approx(29.9)
    assert main([str(tmp_path / "eager"), str(tmp_path / "fast"), "--from-step", "10",
                 "--out", str(out), "--baseline", "fast/sigmoid"]) == 0  # fmt: skip
    assert list(pd.read_csv(out / "step_speed.csv")["paired"]) == [2.0, 1.0]
    w = SummaryWriter(str(tmp_path / "mfu_only" / "sigmoid"))  # a speed tag, no step time
    w.add_scalar(tags.MFU, 0.4, 60)
    w.close()
    assert main([str(tmp_path / "eager"), str(tmp_path / "mfu_only"), "--out", str(out)]) == 0
    no_time = pd.read_csv(out / "step_speed.csv").iloc[1]
    assert no_time["steps"] == 0 and no_time["stalls"] == 0 and no_time["stall_s"] == 0.0
    capsys.readouterr()
    assert main([str(tmp_path / "eager"), "--out", str(out), "--baseline", "nope"]) == 2
    assert "--baseline nope is not among the runs read: eager/sigmoid" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert main([str(tmp_path / "eager"), "--from-step", "1000"]) == 2
    assert "no perf/step_time_s" in capsys.readouterr().err


def _bench_clocks():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "bench" / "bench_clocks.py"
    spec = importlib.util.spec_from_file_location("bench_clocks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_clocks_reads_nvidia_smi_lines_and_takes_medians():
    """experiments/bench/bench_clocks.py: its nvidia-smi lines parsed, unreadable ones dropped,
    and a workload's row from its times and samples."""
    bc = _bench_clocks()
    assert bc.parse_sample("1680, 689.61, 700.00\n") == (1680.0, 689.61, 700.0)
    assert bc.parse_sample("1980, [N/A], 700.00") is None
    assert bc.parse_sample("1980, 600") is None
    samples = [
        (0.0, 1700.0, 650.0, 700.0),
        (0.1, 1600.0, 690.0, 700.0),
        (0.2, 1650.0, 680.0, 700.0),
    ]
    r = bc.row("w", 4, [0.4, 0.2, 0.3], samples)
    assert r["ms_per_seq"] == pytest.approx(75.0) and r["calls"] == 3
    assert r["sm_clock_MHz"] == 1650 and r["sm_clock_min_MHz"] == 1600 and r["power_W"] == 680
    with pytest.raises(RuntimeError, match="w: nvidia-smi gave no samples"):
        bc.row("w", 1, [0.1], [])
