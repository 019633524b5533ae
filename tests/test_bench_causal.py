"""experiments/bench/bench_causal.py: its smoke run on CPU (Triton's interpreter) and its bars from
synthetic rows. No test here reads a speed: the smoke run's timings are of the interpreter."""

import importlib
import math
import pathlib
import re

import pandas as pd
import pytest
import torch

from stabilitylab.analysis import causal_profile as cp

BENCH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench"


@pytest.fixture
def bench(monkeypatch):
    """The script as a module (its folder on sys.path, as when it runs)."""
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("bench_causal")


@pytest.mark.interpreter
def test_smoke_run_writes_rows_and_prints_the_table_and_bars_last(bench, tmp_path, capsys,
                                                                   monkeypatch):  # fmt: skip
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench.main(["--smoke", "--rounds", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "causal.csv")
    assert sorted(rows.provider.unique()) == sorted(bench.PROVIDERS)
    assert len(rows) == 2 * len(bench.PROVIDERS) and set(rows["round"]) == {0, 1}
    ran = rows[~rows.provider.isin(bench.CUDA_ONLY)]
    assert (ran.fwd_ms > 0).all() and (ran.bwd_ms > 0).all(), ran
    assert rows[rows.provider.isin(bench.CUDA_ONLY)].fwd_ms.isna().all()  # no CUDA here
    # FLOPs over the causal half: 4 H D sum T (T + 1) / 2 (B = 64 / 32, H = 128 / 64, T = 32).
    one = rows.iloc[0]
    flops = 4 * 2 * 64 * 2 * 32 * 33 / 2
    assert math.isclose(one.fwd_tflops, flops / one.fwd_ms * 1e-9, rel_tol=1e-9)
    # The fused gated kernel agrees with float64 maths (the script's accuracy line).
    fused = float(re.search(r"fused gated ([0-9.e+-]+)", out).group(1))
    assert fused < 1e-5
    # The table, then the bars, printed last.
    in_kernel = float(re.search(r"fused gate in the kernel ([0-9.e+-]+)", out).group(1))
    assert in_kernel < 1e-5
    table_at = out.index(
        "| T | sigmoid-gated | sigmoid-fused-gate | sigmoid | sigmoid-bias | sigmoid-gv | cudnn |"
    )
    bars_at = out.index("| bar | T | threshold |")
    assert table_at < bars_at
    assert out.rstrip().splitlines()[-1].startswith("| bwd sdpa-gated / flex-gated | 32 |")
    bars = pd.read_csv(tmp_path / "causal_bars.csv")
    for bar in ("fwd gate on / gate off", "bwd fused gate on / gate off"):
        gate = bars[bars.bar == bar].iloc[0]
        assert gate["rounds"] == 2 and gate["status"] in ("met", "tie", "not met"), bar
    assert (bars[bars.bar.str.contains("flex-gated")].status == "no data").all()


def _rows(provider, T, fwd, bwd):
    return [{"provider": provider, "T": T, "round": r, "fwd_tflops": f, "bwd_tflops": b}
            for r, (f, b) in enumerate(zip(fwd, bwd, strict=True))]  # fmt: skip


def test_bars_are_medians_of_per_round_ratios(bench):
    df = pd.DataFrame(
        _rows("sigmoid-gated", 2048, [300, 300, 300], [240, 220, 240])
        + _rows("sigmoid", 2048, [310, 320, 340], [250, 250, 250])
        + _rows("flex-gated", 2048, [285, 285, 285], [230, 230, 230])
        + _rows("sdpa-gated", 2048, [200, 300, 200], [100, 100, 100])
        + _rows("cudnn", 2048, [383, 383, 383], [327, 327, 327])
    )
    table = bench.bars(df).set_index("bar")
    fwd_flex = table.loc["fwd sigmoid-gated / flex-gated"]
    assert fwd_flex["median"] == pytest.approx(300 / 285) and fwd_flex["status"] == "met"
    bwd_flex = table.loc["bwd sigmoid-gated / flex-gated"]  # 220 / 230 in one round
    assert bwd_flex["median"] == pytest.approx(240 / 230) and bwd_flex["status"] == "tie"
    off = table.loc["fwd gate off / cudnn"]  # 0.81-0.89x < 0.9x from 1K
    assert off["median"] == pytest.approx(320 / 383) and off["status"] == "not met"
    gate = table.loc["fwd gate on / gate off"]  # 300 / 340 = 0.88 >= 1 / 1.15 in every round
    assert gate["median"] == pytest.approx(300 / 320) and gate["status"] == "met"
    assert gate["threshold"] == pytest.approx(1 / 1.15)
    assert table.loc["fwd sdpa-gated / flex-gated", "status"] == "flex-gated faster"
    assert table.loc["fwd sdpa-gated / flex-gated", "median"] == pytest.approx(200 / 285)


def test_each_bar_applies_from_its_own_T_with_its_threshold(bench):
    df = pd.DataFrame(
        [
            row
            for T in (256, 512, 1024, 2048)
            for p in ("sigmoid-gated", "sigmoid", "cudnn")
            for row in _rows(p, T, [90, 90], [85, 85])
        ]  # fmt: skip
    )
    table = bench.bars(df)
    at = lambda bar, T: table[(table.bar == f"fwd {bar}") & (table["T"] == T)]
    assert at("gate off / cudnn", 256).empty  # no bar below 512
    assert at("gate off / cudnn", 512).iloc[0][["threshold", "status"]].tolist() == [0.8, "met"]
    assert at("gate off / cudnn", 1024).iloc[0][["threshold", "status"]].tolist() == [0.9, "met"]
    assert at("gate on / gate off", 1024).empty and len(at("gate on / gate off", 2048)) == 1
    assert at("sigmoid-gated / flex-gated", 512).iloc[0]["status"] == "no data"  # no flex rows
    assert bench.bar_threshold(((2048, 0.87),), 32, every_t=True) == 0.87  # a smoke run's T
    assert bench.bar_threshold(((2048, 0.87),), 32, every_t=False) is None


def test_bad_arguments_are_named(bench, capsys):
    cases = [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--hidden", "100"], "--hidden must be a multiple of the head dim 64"),
        (["--providers", "cudnn", "flash-sigmoid"], "unknown providers"),
        (["--profile", "--calls", "0"], "--calls must be >= 1"),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2 and msg in capsys.readouterr().err


def test_defaults_cover_the_kv_study_lengths_at_16k_tokens(bench):
    args = bench.parse_args([])
    assert args.seq_lens == [512, 1024, 2048, 8192] and args.tokens == 16_384
    assert args.providers == bench.PROVIDERS
    profiled = bench.parse_args(["--profile"])
    assert profiled.providers == bench.PROFILE_PROVIDERS and profiled.calls == 20
    x = bench.make_inputs(args.tokens, 128, 1024, "cpu", torch.float32)
    assert x["q"].shape == (16, 2, 1024, 64)  # B = 16384 / T, H = hidden / 64


@pytest.mark.interpreter
def test_profile_smoke_writes_the_breakdown_of_every_provider_and_phase(bench, tmp_path, capsys,
                                                                        monkeypatch):  # fmt: skip
    """--profile on CPU: the leaf aten ops stand in for kernels; the gate's ops land in its roles
    in the gated variant only, and each call's parts add up to its wall time."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bench.main(["--smoke", "--profile", "--calls", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "causal_profile.csv")
    keys = sorted(zip(rows.provider, rows.phase, strict=True))
    assert keys == sorted((p, ph) for p in bench.PROFILE_PROVIDERS for ph in ("fwd", "bwd"))
    ran = rows[rows.provider != "cudnn"].set_index(["provider", "phase"])
    assert (ran.calls == 1).all() and (ran.wall > 0).all() and (ran.wall_unprof > 0).all()
    parts = ran[list(cp.ROLES)].sum(axis=1)
    assert ((parts - ran.wall).abs() <= 1e-6 * ran.wall).all(), (parts, ran.wall)
    for phase in ("fwd", "bwd"):
        gated, off = ran.loc[("sigmoid-gated", phase)], ran.loc[("sigmoid", phase)]
        assert gated[cp.LOG_G] > 0 and gated[cp.GV] > 0, (phase, gated)
        assert off[cp.LOG_G] == 0 and off[cp.GV] == 0 and off[cp.DBIAS] == 0, (phase, off)
        in_kernel = ran.loc[("sigmoid-fused-gate", phase)]  # no elementwise gate work around it
        assert in_kernel[cp.LOG_G] == 0 and in_kernel[cp.GV] == 0, (phase, in_kernel)
    assert ran.loc[("sigmoid-gated", "bwd"), cp.DBIAS] > 0  # the key bias's sum over heads
    assert rows[rows.provider == "cudnn"].wall.isna().all()  # CUDA only: NaN, not dropped
    kernels = pd.read_csv(tmp_path / "causal_profile_kernels.csv")
    log = kernels[(kernels.kernel == "aten::log") & (kernels.provider == "sigmoid-gated")]
    assert list(log.role) == [cp.LOG_G] and list(log.phase) == ["fwd"]
    md = (tmp_path / "causal_profile.md").read_text()
    assert md.index("### forward") < md.index("### backward") < md.index("### largest kernels")
    assert out.rstrip().endswith(md.rstrip().splitlines()[-1])
