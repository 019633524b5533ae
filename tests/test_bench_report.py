"""The benchmark's tables and bars, from synthetic rows (no GPU); the benchmark scripts' CPU-side
parts (argument checks, and the config sweep's launches in Triton's interpreter)."""

import importlib
import math
import pathlib

import pandas as pd
import pytest
import torch

from stabilitylab.analysis.bench_report import bars, bars_markdown, model_step_bar, summary

BENCH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench"


def _script(name: str, monkeypatch):
    """A script of experiments/bench as a module (its folder on sys.path, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module(name)


def rows(provider, D, T, pad, fwd, bwd):
    """One row per round: ``fwd`` and ``bwd`` are per-round TFLOPS lists."""
    return [
        {"provider": provider, "D": D, "T": T, "pad": pad, "round": r,
         "fwd_tflops": f, "bwd_tflops": b}
        for r, (f, b) in enumerate(zip(fwd, bwd, strict=True))
    ]  # fmt: skip


def bar(table, name, D, T):
    hit = table[(table.bar == name) & (table.D == D) & (table["T"] == T)]
    assert len(hit) == 1, (name, D, T, table)
    return hit.iloc[0]


def test_bars_are_medians_of_ratios_paired_by_round():
    df = pd.DataFrame(
        rows("sigmoid-triton", 64, 4096, 0.0, [100, 200, 300], [50, 50, 50])
        + rows("cudnn", 64, 4096, 0.0, [90, 210, 310], [40, 60, 45])
    )
    table = bars(df)
    fwd = bar(table, "fwd vs cudnn", 64, 4096)
    # per round 100/90, 200/210, 300/310: the median is the third, not a ratio of medians
    assert fwd["median"] == pytest.approx(300 / 310)
    assert fwd["low"] == pytest.approx(200 / 210) and fwd["high"] == pytest.approx(100 / 90)
    assert (fwd["rounds"], fwd["rounds_passing"], fwd["status"]) == (3, 1, "not met")
    bwd = bar(table, "bwd vs cudnn", 64, 4096)
    assert bwd["median"] == pytest.approx(50 / 45)
    assert (bwd["rounds_passing"], bwd["status"]) == (2, "tie")  # the median passes, one round not


def test_padding_bar_is_padded_over_unpadded_within_ten_percent():
    df = pd.DataFrame(
        rows("sigmoid-triton", 128, 8192, 0.0, [100, 100], [100, 100])
        + rows("sigmoid-triton", 128, 8192, 0.25, [95, 91], [85, 89])
    )
    table = bars(df)
    assert not (table.bar == "fwd vs cudnn").any()  # no cuDNN rows: that bar is left out
    fwd, bwd = bar(table, "fwd 25% pad", 128, 8192), bar(table, "bwd 25% pad", 128, 8192)
    assert fwd["median"] == pytest.approx(0.93) and fwd["status"] == "met"
    assert bwd["median"] == pytest.approx(0.87) and bwd["status"] == "not met"


def test_bars_skip_short_sequences_and_report_missing_rounds():
    df = pd.DataFrame(
        rows("sigmoid-triton", 64, 2048, 0.0, [100], [100])
        + rows("cudnn", 64, 2048, 0.0, [200], [200])
        + rows("sigmoid-triton", 64, 16384, 0.0, [100, 100], [100, 100])
        + rows("cudnn", 64, 16384, 0.0, [float("nan"), float("nan")], [80, 90])
    )
    table = bars(df)
    assert set(table["T"]) == {16384}
    fwd = bar(table, "fwd vs cudnn", 64, 16384)
    assert fwd["status"] == "no data" and fwd["rounds"] == 0
    assert bar(table, "bwd vs cudnn", 64, 16384)["status"] == "met"
    md = bars_markdown(table)
    assert "| fwd vs cudnn | 64 | 16384 | - |" in md
    assert f"{((100 / 80 + 100 / 90) / 2 - 1) * 100:+.1f}%" in md  # median of two rounds


def test_softmax_kernel_bars_are_point_nine_of_cudnn_autotuned_and_deterministic():
    df = pd.DataFrame(
        rows("softmax-triton", 64, 8192, 0.0, [95, 91], [85, 97])
        + rows("softmax-triton-det", 64, 8192, 0.0, [80, 80], [90, 90])
        + rows("softmax-triton", 64, 2048, 0.0, [10], [10])  # below 4K: no bar
        + rows("cudnn", 64, 8192, 0.0, [100, 100], [100, 100])
        + rows("cudnn", 64, 2048, 0.0, [100], [100])
    )
    table = bars(df)
    assert not (table.bar == "fwd vs cudnn").any()  # no sigmoid rows: the op's bars are left out
    fwd = bar(table, "softmax-triton fwd vs cudnn", 64, 8192)
    assert fwd["median"] == pytest.approx(0.93) and fwd["status"] == "met"
    assert bar(table, "softmax-triton bwd vs cudnn", 64, 8192)["status"] == "tie"
    assert bar(table, "softmax-triton-det fwd vs cudnn", 64, 8192)["status"] == "not met"
    assert bar(table, "softmax-triton-det bwd vs cudnn", 64, 8192)["status"] == "met"
    assert set(table["T"]) == {8192} and len(table) == 4


def test_deterministic_providers_run_in_deterministic_mode_and_restore_it(monkeypatch):
    """A ``-det`` provider is its base provider's forward timed with
    torch.use_deterministic_algorithms on; the mode before is back after, even on an error, and
    the other providers are timed with it off."""
    bench_attention = _script("bench_attention", monkeypatch)
    seen = []
    monkeypatch.setattr(
        bench_attention,
        "_time_fwd_bwd",
        lambda fwd, q, k, v: seen.append(torch.are_deterministic_algorithms_enabled()) or (1, 2),
    )
    q = k = v = torch.zeros(1, 1, 8, 64)
    assert not torch.are_deterministic_algorithms_enabled()
    for name in ("softmax-triton-det", "softmax-triton", "flash-det"):
        assert bench_attention.time_provider(name, lambda: None, q, k, v) == (1, 2)
        assert not torch.are_deterministic_algorithms_enabled()
    assert seen == [True, False, True]
    with pytest.raises(RuntimeError), bench_attention.deterministic_mode(True):
        raise RuntimeError("a provider failed")
    assert not torch.are_deterministic_algorithms_enabled()
    lengths = torch.tensor([8])
    for name in bench_attention.DETERMINISTIC_PROVIDERS:
        assert callable(bench_attention.provider_fn(name, q, k, v, lengths)), name
    assert bench_attention.provider_fn("flash-det", q, k, v, torch.tensor([5])) is None  # padded


def test_bench_attention_rejects_unknown_providers_naming_the_deterministic_ones(
    capsys, monkeypatch
):
    bench_attention = _script("bench_attention", monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(["--providers", "cudnn-det"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown providers ['cudnn-det']" in err and "flash-det" in err


def test_summary_cells_are_medians_over_rounds():
    df = pd.DataFrame(
        rows("sigmoid-triton", 64, 4096, 0.25, [10, 30, 20], [1, 3, 2])
        + rows("flash", 64, 4096, 0.25, [float("nan")] * 3, [float("nan")] * 3)
    )
    table = summary(df)
    assert list(table.columns) == ["D", "T", "pad_pct", "sigmoid-triton", "flash"]
    assert table.iloc[0]["sigmoid-triton"] == "20 / 2"
    assert table.iloc[0]["flash"] == "- / -" and table.iloc[0]["pad_pct"] == 25


def test_model_step_bar_pairs_backends_by_round():
    df = pd.DataFrame(
        [{"backend": b, "micro_batch": 1, "round": r, "step_ms": ms}
         for r, (soft, sig) in enumerate([(55.0, 50.0), (54.0, 56.0), (56.0, 53.0)])
         for b, ms in (("softmax", soft), ("sigmoid-triton", sig))]
    )  # fmt: skip
    row = model_step_bar(df).iloc[0]
    assert row["softmax_ms"] == 55.0 and row["sigmoid_triton_ms"] == 53.0
    # per round 50/55, 56/54, 53/56: the median is the third
    assert row["change_pct_median"] == pytest.approx((53 / 56 - 1) * 100)
    assert row["change_pct_high"] == pytest.approx((56 / 54 - 1) * 100)
    assert row["status"] == "tie"  # faster in the median, slower in round 1
    assert model_step_bar(df[df["round"] != 1]).iloc[0]["status"] == "met"
    slower = df.assign(step_ms=df.step_ms.where(df.backend == "softmax", 60.0))
    assert model_step_bar(slower).iloc[0]["status"] == "not met"
    assert not math.isnan(model_step_bar(slower).iloc[0]["change_pct_low"])


def test_a_round_where_the_op_failed_fails_the_bar():
    df = pd.DataFrame(
        rows("sigmoid-triton", 64, 8192, 0.0, [float("nan"), 100, float("nan")], [100] * 3)
        + rows("cudnn", 64, 8192, 0.0, [120, 90, 80], [float("nan"), 90, 80])
    )
    table = bars(df)
    fwd = bar(table, "fwd vs cudnn", 64, 8192)
    assert (fwd["rounds"], fwd["rounds_passing"], fwd["status"]) == (3, 1, "not met")
    assert fwd["low"] == 0.0
    bwd = bar(table, "bwd vs cudnn", 64, 8192)  # no cuDNN figure in round 0: left out
    assert (bwd["rounds"], bwd["rounds_passing"], bwd["status"]) == (2, 2, "met")


def test_bench_attention_rejects_zero_rounds(capsys, monkeypatch):
    bench_attention = _script("bench_attention", monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        bench_attention.main(["--rounds", "0"])
    assert exit_info.value.code == 2  # argparse's error, before the check for a GPU
    assert "--rounds must be >= 1" in capsys.readouterr().err


@pytest.mark.interpreter
def test_sweep_configs_launches_each_kernel_as_the_op_does(monkeypatch):
    """The sweep launches the op's kernels directly, with the op's private argument builders: at
    the interpreter's tiles its forward, dQ and dK/dV equal the op's launchers bit for bit, on
    both load paths, so a change of a kernel's signature cannot leave the sweep behind."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sweep = _script("sweep_configs", monkeypatch)
    sa = importlib.import_module("stabilitylab.kernels.sigmoid_attention")  # the module
    gen = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 2, 40, 64
    q, k, v, do = (torch.randn(B, H, T, D, generator=gen).half() for _ in range(4))
    lengths = torch.tensor([40, 23])
    args = (lengths, 1 / math.sqrt(D), 0.0, True, sa.TANH_F32)
    tile = (sa.INTERPRETER_BLOCKS["BLOCK_M"], sa.INTERPRETER_BLOCKS["BLOCK_N"], 4, 2)
    for tma in (False, True):
        (out, _), grads = (
            sa._forward(q, k, v, *args, False, tma),
            sa._backward(do, q, k, v, *args, tma),
        )
        for kind, want in (("fwd", (out,)), ("dq", grads[:1]), ("dkdv", grads[1:])):
            launch, got = sweep.runner(kind, D, tma, tile, (q, k, v, do, lengths))
            launch()
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a, b), (kind, tma)
    with pytest.raises(SystemExit, match="BMxBNxWxS"):
        sweep.parse_configs(["dq=128x64x8"])


def test_bench_model_rows_carry_mfu_and_mfu_labelled(monkeypatch):
    """``mfu`` counts the head on every position, ``mfu_labelled`` on the labelled ones only (the
    rest of the model alike); the row names the backend that ran."""
    from stabilitylab.model import dense_parameter_count, flops_per_step, head_parameter_count
    from stabilitylab.presets import smoke
    from stabilitylab.train.levers import build_rig

    bench_model = _script("bench_model", monkeypatch)
    cfg = smoke()
    rig = build_rig(cfg, "softmax", "det", "cpu")
    entry = {"rig": rig, "times": {"bare": [0.5, 0.25, 0.75]}, "peak_mem_GiB": 0.0, "first_s": 1}
    row = bench_model.summarise(cfg, entry, peak_tflops=1e-3)
    B, T = rig.batch[0].shape
    flops = flops_per_step(cfg.model, dense_parameter_count(rig.model), [T] * B)
    unlabelled = int((rig.batch[2] == -100).sum())
    head_flops = 6.0 * head_parameter_count(rig.model) * unlabelled
    assert row["arm / variant"] == "softmax-reference / det"
    assert row["step_ms"] == 500.0
    assert row["mfu"] == pytest.approx(flops / 0.5 / 1e9)
    assert row["mfu_labelled"] == pytest.approx((flops - head_flops) / 0.5 / 1e9)
    assert 0 < row["mfu_labelled"] < row["mfu"]
