"""experiments/bench/bench_decode.py: its smoke run end to end on CPU, the synthetic eviction
pattern, the anchors' maths, the bars from synthetic rows and the refusals. No test reads a
speed: the smoke run's timings are of a shared CPU."""

from __future__ import annotations

import importlib
import math
import pathlib

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from stabilitylab.inference import bench, bench_steps
from stabilitylab.inference.engine import DecodeEngine

BENCH = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "bench"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("bench_decode")


def test_smoke_run_writes_every_table(script, tmp_path, capsys, one_thread):
    """Flex is left out here (its CPU tracing takes seconds; ``test_flex_anchor_...``)."""
    assert script.main(["--smoke", "--flex-contexts", "--out", str(tmp_path)]) == 0
    df = pd.read_csv(tmp_path / "decode.csv")
    assert list(df.columns) == bench.COLUMNS
    eng = df[df.provider == "engine"]
    assert sorted(eng.compression.unique()) == [0.0, 0.25, 0.5, 0.75, 0.9]
    assert len(eng) == 2 * 5 and set(df.batch) == {1, 2} and set(df.provider) == {"engine", "sdpa"}
    assert (df.step_ms > 0).all() and (df.attn_ms > 0).all() and df.note.isna().sum() == 2
    assert ((df.rest_ms - (df.step_ms - df.attn_ms)).abs() < 1e-9).all()
    assert ((df.tokens_per_s - df.batch / df.step_ms * 1e3).abs() < 1e-6 * df.tokens_per_s).all()
    # More eviction, fewer pages held; the pages cover the live entries.
    for _, g in eng.groupby("batch"):
        held = g.sort_values("compression").kv_held_bytes.tolist()
        assert held == sorted(held, reverse=True) and held[-1] < held[0]
    assert (eng.kv_held_bytes >= eng.kv_live_bytes).all()
    bars = pd.read_csv(tmp_path / "decode_bars.csv")
    assert set(bars.status) <= {"met", "not met", "no data"}
    assert (bars.bar == "sdpa step / engine dense step").sum() == 2
    out = capsys.readouterr().out
    assert "| size | batch | context | compression | provider |" in out and "## Bars" in out
    assert (tmp_path / "decode.md").read_text().startswith("# Decode")
    assert (tmp_path / "provenance.json").is_file()
    assert not (tmp_path / "decode.partial.csv").exists()  # removed once the grid is whole


def test_a_grid_stopped_midway_keeps_the_rows_so_far(one_thread):
    """``partial`` sees the rows after every (size, batch, context), each frame extending the
    last, the final one equal to the returned grid."""
    cfg = bench.smoke_config()
    cfg.flex_contexts, cfg.contexts = [], [16, 24]
    frames = []
    df = bench.run_grid(cfg, log=lambda _: None, partial=frames.append)
    assert [len(f) for f in frames] == [6, 12, 18, 24]  # 5 engine rows + sdpa per (B, N)
    for a, b in zip(frames, frames[1:], strict=False):
        pd.testing.assert_frame_equal(a, b.iloc[: len(a)])
    pd.testing.assert_frame_equal(frames[-1], df)


def test_the_eviction_pattern_is_drawn_to_the_target(one_thread):
    cfg = bench.smoke_config()
    model = bench_steps.random_model("smoke", cfg, 600)
    engine = DecodeEngine(model, batch=4, max_entries=520, attention="reference", page_size=8)
    gen = torch.Generator().manual_seed(0)
    for c in (0.0, 0.5, 0.9):
        bench_steps.fill(engine, 512, c, gen)
        facts = bench_steps.kv_facts(engine, 512)
        assert abs(facts["achieved_compression"] - c) < 0.03
        for cache in engine.caches:
            assert (cache.held_BH == (cache.count_BH + 7) // 8).all()
            held = cache.table_BHM[
                torch.arange(cache.table_BHM.shape[2]) < cache.held_BH[..., None]
            ]
            free = cache.free_F[: int(cache.n_free)]
            assert sorted(held.tolist() + free.tolist()) == list(range(cache.n_pages))
        assert facts["kv_held_bytes"] <= facts["kv_live_bytes"] + 4 * 2 * 2 * 8 * 64 * 4


def test_flex_anchor_computes_sdpa_with_the_key_bias(one_thread):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 16, generator=gen)
    k, v = torch.randn(2, 2, 9, 16, generator=gen), torch.randn(2, 2, 9, 16, generator=gen)
    kb = torch.rand(2, 1, 1, 9, generator=gen).log()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=kb)
    torch.testing.assert_close(bench_steps.sdpa_attend(q, k, v, kb), want)
    torch.testing.assert_close(bench_steps.flex_attend_fn(torch.device("cpu"))(q, k, v, kb), want)


def _rows(**kw):
    base = {"size": "paper", "kind": "softmax", "batch": 32, "context": 32768}
    return {**base, **kw}


def test_bars_are_ratios_of_this_run():
    df = pd.DataFrame([
        _rows(provider="engine", compression=0.0, step_ms=10.0, attn_ms=8.0, tokens_per_s=3200.0,
              kv_held_bytes=100, kv_live_bytes=100),
        _rows(provider="engine", compression=0.5, step_ms=6.0, attn_ms=4.0, tokens_per_s=5333.3,
              kv_held_bytes=53, kv_live_bytes=50),
        _rows(provider="sdpa", compression=0.0, step_ms=11.0, attn_ms=9.0),
    ])  # fmt: skip
    b = bench.bars(df).set_index("bar")
    assert b.loc["sdpa step / engine dense step", "value"] == pytest.approx(1.1)
    assert b.loc["sdpa step / engine dense step", "status"] == "met"
    assert b.loc["engine attention at 50% / dense", "value"] == pytest.approx(0.5)
    assert b.loc["engine tokens/s at 50% / dense", "status"] == "met"
    assert b.loc["KV held / live at c = 0.5", "value"] == pytest.approx(1.06)
    assert b.loc["KV held / live at c = 0.5", "status"] == "not met"
    no_sdpa = bench.bars(df[df.provider == "engine"]).set_index("bar")
    assert no_sdpa.loc["sdpa step / engine dense step", "status"] == "no data"
    assert math.isnan(no_sdpa.loc["sdpa step / engine dense step", "value"])


@pytest.mark.parametrize(
    "argv,match",
    [(["--compressions", "1.0"], "--compressions must lie in"),
     (["--steps", "0"], "must be >= 1"),
     (["--run", "runs/no_such_study"], "no study/table2.csv"),
     ([], "no CUDA device")],
)  # fmt: skip
def test_bad_arguments_get_one_error_line(argv, match, capsys, tmp_path):
    if not argv and torch.cuda.is_available():
        pytest.skip("CUDA is here")
    smoke = ["--smoke"] if argv else []
    assert bench.main([*smoke, *argv, "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("error: ") and match in out[0]


@pytest.mark.gpu
def test_the_grid_runs_every_provider_on_the_gpu(tmp_path):
    argv = ["--sizes", "smoke", "--contexts", "300", "--batches", "1", "3", "--steps", "3",
            "--repeats", "2", "--flex-contexts", "300", "--out", str(tmp_path)]  # fmt: skip
    assert bench.main(argv) == 0
    df = pd.read_csv(tmp_path / "decode.csv")
    assert set(df.provider) == {"engine", "sdpa", "flex"}
    ran = df[df.note.isna() | (df.provider == "engine")]
    assert (ran.step_ms > 0).all() and (ran.attn_ms > 0).all(), df
    assert (df[df.provider == "engine"].note == "triton").all()
