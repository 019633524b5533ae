"""The KV-eviction study's eviction side on CPU: one tiny 8-cell run (30 steps) per module, the
study's command on it (tables, Figure 1, study.md), the tables' consistency, a grid that really
evicts, and the refusals (tau, budget, configs, an encoder, an unfinished cell)."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from stabilitylab import config as C
from stabilitylab.analysis.kv_study import (
    FIG1,
    FIG2,
    FIG3,
    FIG4,
    NOT_TIMED,
    PROBE_TABLES,
    merge_studies,
    time_study,
    write_study,
)
from stabilitylab.cli import kv_study_main
from stabilitylab.eviction import (
    H2O,
    MAX_DELTA_LOG_PPL,
    TAU_GRID,
    Budget,
    KeyDiff,
    NoEviction,
    TauRule,
    evaluate,
    evaluate_baseline,
    full_budget,
    matched_budget,
    select_tau_index,
)
from stabilitylab.eviction.cells import StudyError, dense_backbone, load_cell, load_cells
from stabilitylab.eviction.speed import DECODE_SPEED_COLUMNS, recorded_selections, spread
from stabilitylab.eviction.study import run_study, study_inputs
from stabilitylab.train import run
from stabilitylab.train.resume import config_changes
from tests.tiny_runs import arm_dir
from tests.tiny_runs import tiny as smoke

STEPS = 30
STUDY = [
    "--study.val_windows=2", "--study.test_windows=2", "--study.batch_size=2",
    "--study.prefill=16", "--study.window=16", "--study.probe_windows=2",
]  # fmt: skip
TABLES = ("table1", "table2", "table5", "sweep_test", "comparisons", "decode_speed")
GATED = [c for c in C.CELLS if "-g-" in c]
EVICTING_GRID = (0.0, 0.5, 0.9932, 0.9935, 1.0)
"""After 30 steps every gate is near sigmoid(5) = 0.9933 (the preset's ramp and per-gate lambda
keep them within 0.9931-0.9933): the grid's points around it evict a part of the tokens, 1.0
evicts every gated entry."""


def tiny(out_dir, *overrides) -> C.Config:
    return C.parse(
        ["--preset", "tiny", f"--out_dir={out_dir}", f"--train.steps={STEPS}", "--report=False",
         *overrides]
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The 8 tiny cells, trained once, then the study's command over them with other study.*
    values than the training saw (a trained cell must not refuse to resume for those)."""
    out = tmp_path_factory.mktemp("kvstudy")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models on a small shared CPU: one thread is faster
    try:
        run(tiny(out))
        argv = ["--preset", "tiny", f"--out_dir={out}", f"--train.steps={STEPS}", "--report=False"]
        code = kv_study_main([*argv, *STUDY])
        yield tiny(out, *STUDY), out / "kv_tiny", code
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def evicting(trained):
    """The study of one gated cell and its backbone on a grid that evicts."""
    cfg, run_dir, _ = trained
    cells = load_cells(run_dir, ["sig-rope", "sig-g-rope"], expect=cfg)
    inputs = study_inputs(cfg, cells, grid=EVICTING_GRID)
    return cells, inputs, run_study(cells, inputs)


@pytest.fixture(scope="module")
def untimed(evicting):
    """The same study with timing off (what each process of the parallel study writes)."""
    cells, inputs, _ = evicting
    return run_study(cells, inputs, timing=False)


def read(run_dir: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(run_dir / "study" / f"{name}.csv")


# ---- the command and its files ----------------------------------------------------------------


def test_the_study_command_writes_every_table_and_figure(trained):
    _, run_dir, code = trained
    assert code == 0
    d = run_dir / "study"
    for name in TABLES:
        assert (d / f"{name}.md").read_text().startswith(f"| {read(run_dir, name).columns[0]} |")
    assert len(read(run_dir, "table1")) == 8 and len(read(run_dir, "table2")) == 4
    assert len(read(run_dir, "table5")) == 4 * 15 and len(read(run_dir, "decode_speed")) == 4
    for fig in (FIG1, FIG2, FIG3, FIG4):
        assert (d / fig).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", fig
    md = (d / "study.md").read_text()
    assert all(f"]({fig})" in md for fig in (FIG1, FIG2, FIG3, FIG4))
    assert all(f"## {name}" in md for name in (*TABLES, *PROBE_TABLES))
    # The diagnostics: every cell, both protocols, 3 fractions; softmax rows sum to 1.
    removal = read(run_dir, "support_removal")
    assert set(removal["cell"]) == set(C.CELLS) and set(removal["p"]) == {0.1, 0.3, 0.5}
    rows = read(run_dir, "rowsum_binarization")
    for stat in ("row_sum_cv_norm", "row_sum_cv_raw"):
        softmax = rows[rows["kind"] == "softmax"][stat]
        assert len(softmax) and (softmax.abs() < 1e-9).all(), stat
        assert (rows[rows["kind"] == "sigmoid"][stat] > 0).all(), stat
    assert set(read(run_dir, "table4_categories")["cell"]) == set(GATED)
    assert "2 validation and 2 test windows" in md


def test_the_tables_agree_with_each_other(trained):
    _, run_dir, _ = trained
    t1 = read(run_dir, "table1").set_index("cell")
    t2, t5 = read(run_dir, "table2"), read(run_dir, "table5")
    assert (t1["n_windows"] == 2).all() and (t1["n_targets"] == 2 * 16).all()
    assert t1["test_ppl"].between(1, 595).all()  # better than uniform over the 595 ids
    for col in ("compression", "compression_evictable", "compression_L0", "compression_L1"):
        assert t5[col].between(0, 1).all(), col
    assert (t5["compression_L0"] == 0).all(), "no gate precedes layer 0"
    for _, row in t2.iterrows():
        assert row["backbone"] == dense_backbone(row["cell"])
        assert row["test_ppl_tau0"] == pytest.approx(t1.loc[row["cell"], "test_ppl"], rel=1e-12)
        assert row["backbone_test_ppl"] == pytest.approx(t1.loc[row["backbone"], "test_ppl"])
        sweep = t5[t5["cell"] == row["cell"]]
        assert list(sweep["tau"]) == list(TAU_GRID)
        assert sweep.loc[sweep["selected"], "tau"].tolist() == [row["tau_star"]]
        if row["test_compression"] == 0:  # tiny gates stay above every grid point: full budget
            # The dense PPL comes from the masked one-pass evaluation, the baselines from the
            # loop: the same maths in float32, summed in another order.
            assert row["h2o_test_ppl"] == pytest.approx(row["backbone_test_ppl"], rel=1e-6)
            assert row["keydiff_test_ppl"] == pytest.approx(row["backbone_test_ppl"], rel=1e-6)
    speed = read(run_dir, "decode_speed")
    assert list(speed.columns) == DECODE_SPEED_COLUMNS
    assert (speed[["dense_s", "tau_star_s", "dense_tokens_per_s"]] > 0).all().all()
    np.testing.assert_allclose(speed["live_kv_ratio"], 1 - speed["compression"], rtol=1e-9)
    assert speed["measured_alone"].all() and (speed["repeats"] == 3).all()
    assert list(speed["tau_star"]) == list(t2.set_index("cell").loc[speed["cell"], "tau_star"])


# ---- decode speed -----------------------------------------------------------------------------


def test_spread_is_the_median_min_and_max():
    assert spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert spread([4.0, 1.0]) == (2.5, 1.0, 4.0) and spread([0.5]) == (0.5, 0.5, 0.5)
    with pytest.raises(ValueError, match="at least one"):
        spread([])


def test_repeated_timings_report_a_consistent_median_and_spread(evicting):
    _, _, result = evicting
    speed = result.decode_speed
    assert list(speed["cell"]) == ["sig-g-rope"] and (speed["repeats"] == 3).all()
    for col in ("dense_s", "tau_star_s"):
        assert (speed[f"{col}_min"] <= speed[col]).all() and (speed[col] <= speed[f"{col}_max"]).all()  # fmt: skip
    np.testing.assert_allclose(speed["speedup"], speed["dense_s"] / speed["tau_star_s"])
    np.testing.assert_allclose(speed["dense_tokens_per_s"], speed["decode_tokens"] / speed["dense_s"])  # fmt: skip
    assert speed["tau_star"].iloc[0] == result.table2["tau_star"].iloc[0]


def test_an_untimed_study_has_an_empty_decode_speed_that_merges(trained, untimed, tmp_path):
    _, run_dir, _ = trained
    assert untimed.decode_speed.empty and list(untimed.decode_speed.columns) == DECODE_SPEED_COLUMNS
    pair = write_study(untimed.tables(), tmp_path / "pair")["study.md"].parent
    assert NOT_TIMED in (pair / "study.md").read_text()
    rest = _study_without_sig_rope(run_dir, tmp_path / "rest")
    paths = merge_studies([rest, pair], tmp_path / "merged")
    speed = pd.read_csv(paths["decode_speed.csv"])
    assert list(speed.columns) == DECODE_SPEED_COLUMNS
    assert sorted(speed["cell"]) == ["sig-g-nope", "sm-g-nope", "sm-g-rope"]  # rest's rows only
    alone = merge_studies([pair], tmp_path / "alone")
    assert pd.read_csv(alone["decode_speed.csv"]).empty
    assert NOT_TIMED in alone["study.md"].read_text()


def test_timing_a_written_study_reads_tau_star_from_its_table2(trained, untimed, tmp_path):
    """The parallel study's parent: tau* from the joined table2 (the rule checked again on
    table5's validation sweep), timed alone, decode_speed and study.md rewritten."""
    cfg, run_dir, _ = trained
    study = write_study(untimed.tables(), tmp_path / "study", "Run X.")["study.md"].parent
    other = tiny(run_dir.parent, *STUDY, "--study.timing_repeats=2")
    paths = time_study(other, study, "cpu")
    speed = pd.read_csv(paths["decode_speed.csv"])
    t2 = pd.read_csv(study / "table2.csv")
    assert list(speed["cell"]) == ["sig-g-rope"] and list(speed["tau_star"]) == list(t2["tau_star"])
    assert speed["measured_alone"].all() and (speed["repeats"] == 2).all()
    assert speed["compression"].iloc[0] == pytest.approx(t2["test_compression"].iloc[0])
    md = paths["study.md"].read_text()
    assert md.startswith("# KV-eviction study\n\n**Ran:** 2 cells (sig-rope, sig-g-rope)")
    assert "\n\nRun X.\n\ndecode_speed: timed after the study's" in md
    section = md.split("\n## decode_speed\n")[1].split("\n## ")[0]
    assert NOT_TIMED not in section and "measured_alone" in section
    assert f"| sig-g-rope | {t2['tau_star'].iloc[0]:.4g} | cpu | True | 2 |" in section
    assert pd.read_csv(paths["table5.csv"]).equals(pd.read_csv(study / "table5.csv"))


def test_a_recorded_tau_star_the_rule_does_not_select_is_refused(untimed, tmp_path):
    t2, t5 = untimed.table2.copy(), untimed.table5
    decode = untimed.decode
    assert recorded_selections(t2, t5, decode)["sig-g-rope"].tau == t2["tau_star"].iloc[0]
    other = [t for t in EVICTING_GRID if t != t2["tau_star"].iloc[0]][0]
    t2["tau_star"] = other
    with pytest.raises(StudyError, match=f"table2 gives sig-g-rope tau\\* = {other}, but the rule"):
        recorded_selections(t2, t5, decode, "joined")
    with pytest.raises(StudyError, match=r"no column \['fingerprint'\]"):
        recorded_selections(t2.drop(columns="fingerprint"), t5, decode)


def test_timing_refuses_a_tau_star_selected_on_another_model(trained, untimed, tmp_path):
    cfg, run_dir, _ = trained
    study = write_study(untimed.tables(), tmp_path / "study")["study.md"].parent
    t2 = pd.read_csv(study / "table2.csv")
    t2["fingerprint"] = "0" * 16
    t2.to_csv(study / "table2.csv", index=False)
    with pytest.raises(StudyError, match="tau\\* of sig-g-rope was selected on another model"):
        time_study(cfg, study, "cpu")
    with pytest.raises(StudyError, match="scored 32 test tokens of sig-g-rope, .* give 16"):
        time_study(tiny(run_dir.parent, *STUDY, "--study.test_windows=1"), study, "cpu")


def test_a_bad_timing_repeats_is_refused_by_key(tmp_path):
    with pytest.raises(C.ConfigError, match="config study.timing_repeats: must be >= 1"):
        tiny(tmp_path, "--study.timing_repeats=0")


# ---- a grid that evicts -----------------------------------------------------------------------


def test_a_grid_that_evicts_selects_tau_star_by_the_rule(evicting):
    _, _, result = evicting
    t5 = result.table5
    assert list(t5["tau"]) == list(EVICTING_GRID)
    comp = t5["compression"].to_numpy()
    # Two layers: the only gate is layer 0's, which no eviction changes, so what tau evicts
    # grows with tau; tau = 1 evicts every entry of layer 1, half of all.
    assert (np.diff(comp) >= 0).all() and comp[-1] == 0.5 and comp[0] == 0
    assert 0 < comp[2] < 0.5
    i = select_tau_index(list(t5["tau"]), list(t5["ppl"]), list(comp), rule=TauRule())
    row = result.table2.iloc[0]
    assert row["tau_star"] == t5["tau"][i] and t5["selected"].tolist() == [
        k == i for k in range(len(t5))
    ]
    # The default relative rule: Delta ln PPL <= 0.0045, recorded per grid point.
    assert t5["delta_log_ppl"][i] <= MAX_DELTA_LOG_PPL and t5["accepted"][i]
    assert (t5["accepted"] == (t5["delta_log_ppl"] <= MAX_DELTA_LOG_PPL)).all()
    assert not (t5["accepted"] & (t5["compression"] > comp[i])).any()
    assert row["tau_rule"] == "relative" and row["tau_rule_max_delta"] == MAX_DELTA_LOG_PPL


def test_the_baselines_keep_the_matched_number_of_entries(evicting):
    """A budget matched to the sweep's tau = 0.9932 (some tokens evicted, some kept): H2O and
    KeyDiff on the backbone end with exactly the gate's live entries per window and layer."""
    cells, inputs, result = evicting
    sweep = result.gated["sig-g-rope"].sweep
    gate = sweep.results[sweep.taus.index(0.9932)]
    assert 0 < gate.compression < 0.5
    for policy in (H2O(), KeyDiff()):
        budget = matched_budget(gate, mode="final")
        r = evaluate_baseline(cells["sig-rope"].model, inputs.val, policy, budget)
        np.testing.assert_array_equal(r.live_NL, gate.live_NL)
        assert r.compression == gate.compression and r.window_indices == gate.window_indices
    row = result.table2.iloc[0]
    assert row["h2o_compression"] == row["keydiff_compression"] == row["test_compression"]


def test_tau0_of_the_sweep_is_the_dense_decode_of_the_same_model(evicting):
    cells, inputs, result = evicting
    sweep = result.gated["sig-g-rope"].sweep
    dense = evaluate(
        cells["sig-g-rope"].model, inputs.val, NoEviction(), inputs.decode,
        max_windows=inputs.val_windows,
    )  # fmt: skip
    tau0 = sweep.results[sweep.taus.index(0.0)]
    assert tau0.window_indices == dense.window_indices
    assert tau0.ppl == pytest.approx(dense.ppl, rel=1e-12)


def test_baselines_at_full_budget_reproduce_the_dense_ppl(evicting):
    cells, inputs, result = evicting
    model = cells["sig-rope"].model
    budget = full_budget(
        inputs.test, model.cfg.n_layers, model.cfg.n_heads, inputs.decode,
        max_windows=inputs.test_windows,
    )  # fmt: skip
    dense = result.dense["test"]["sig-rope"]
    for policy in (H2O(), KeyDiff()):
        r = evaluate_baseline(model, inputs.test, policy, budget)
        assert r.compression == 0
        # dense ran through the masked one-pass evaluation; the baselines through the loop
        assert r.ppl == pytest.approx(dense.ppl, rel=1e-6), policy.name


def test_a_gated_cell_without_its_backbone_gets_nan_baselines_and_a_note(evicting):
    cells, inputs, _ = evicting
    result = run_study({"sig-g-rope": cells["sig-g-rope"]}, inputs, timing=False)
    row = result.table2.iloc[0]
    assert row["backbone"] == "sig-rope" and "sig-rope not trained" in row["note"]
    for col in ("backbone_test_ppl", "h2o_test_ppl", "keydiff_test_ppl", "h2o_even_test_ppl"):
        assert np.isnan(row[col]), col
    assert np.isfinite(row["test_ppl_tau_star"]) and result.decode_speed.empty


def _study_without_sig_rope(run_dir: Path, dest: Path) -> Path:
    """The trained study's tables without the sig-rope / sig-g-rope pair, under ``dest``."""
    dest.mkdir()
    for name in ("table1", "table2", "support_removal"):
        t = read(run_dir, name)
        keep = ~t["cell"].str.startswith("sig-") | t["cell"].str.endswith("nope")
        t[keep].to_csv(dest / f"{name}.csv", index=False)
    for name in ("table5", "decode_speed"):
        t = read(run_dir, name)
        t[t["cell"] != "sig-g-rope"].to_csv(dest / f"{name}.csv", index=False)
    return dest


def test_studies_of_disjoint_cells_merge_into_one(trained, evicting, tmp_path):
    _, run_dir, _ = trained
    _, _, result = evicting
    pair = write_study(result.tables(), tmp_path / "pair")
    whole = run_dir / "study"
    with pytest.raises(ValueError, match="sig-g-rope"):  # the same cell twice
        merge_studies([whole, pair["study.md"].parent], tmp_path / "twice")
    rest = _study_without_sig_rope(run_dir, tmp_path / "rest")
    paths = merge_studies([rest, tmp_path / "pair"], tmp_path / "merged")
    merged = pd.read_csv(paths["table1.csv"])
    assert sorted(merged["cell"]) == sorted(C.CELLS)
    assert len(pd.read_csv(paths["table2.csv"])) == 4
    assert (tmp_path / "merged" / FIG1).is_file() and (tmp_path / "merged" / FIG2).is_file()
    with pytest.raises(ValueError, match="table1"):
        write_study({"table2": merged}, tmp_path / "bad")


# ---- refusals ---------------------------------------------------------------------------------


def test_a_tau_outside_0_1_is_refused_before_any_evaluation(trained, evicting):
    cfg, _, _ = trained
    cells, _, _ = evicting
    with pytest.raises(ValueError, match=r"tau must be a number in \[0, 1\], got 1.5"):
        study_inputs(cfg, cells, grid=(0.0, 0.5, 1.5))


def test_a_baseline_budget_larger_than_the_sequence_is_refused(evicting):
    cells, inputs, _ = evicting
    model = cells["sig-rope"].model
    full = full_budget(inputs.test, 2, model.cfg.n_heads, inputs.decode, max_windows=2)
    over = Budget(full.split, full.decode, full.window_indices, full.live_NL * 2, "too many")
    with pytest.raises(ValueError, match=r"budget of 64 entries per head .* exceeds the sequence's 32 tokens"):  # fmt: skip
        evaluate_baseline(model, inputs.test, H2O(), over)


def test_runs_trained_with_another_model_shape_are_refused_by_key(trained):
    cfg, run_dir, _ = trained
    other = tiny(run_dir.parent, "--model.d_ff=128")
    with pytest.raises(StudyError, match=r"model.d_ff: 256 in the runs, 128 in this config"):
        load_cells(run_dir, expect=other)


def test_the_command_refuses_mismatched_runs_with_one_error_line(trained, capsys):
    cfg, run_dir, _ = trained
    argv = ["--preset", "tiny", f"--out_dir={run_dir.parent}", f"--train.steps={STEPS}"]
    with pytest.raises(SystemExit) as e:
        kv_study_main([*argv, "--model.d_ff=128"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "model.d_ff: 256 -> 128" in err[0]


def _copy_cells(run_dir: Path, dest: Path, *cells: str) -> Path:
    for c in cells:
        shutil.copytree(run_dir / c, dest / c)
    return dest


def _edit(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def test_cells_with_different_shared_settings_are_refused_naming_keys(trained, tmp_path):
    _, run_dir, _ = trained
    d = _copy_cells(run_dir, tmp_path, "sm-rope", "sig-g-rope")
    _edit(d / "sig-g-rope" / "config.json", lambda c: c["train"].update(lr=0.002, seed=7))
    with pytest.raises(StudyError, match="not a paired") as e:
        load_cells(d)
    assert "train.lr: sm-rope=0.001, sig-g-rope=0.002" in str(e.value)
    assert "train.seed: sm-rope=42, sig-g-rope=7" in str(e.value)
    assert "model.gates" not in str(e.value) and "backend" not in str(e.value)


def test_an_encoder_checkpoint_is_refused(tmp_path):
    run(smoke(tmp_path / "enc", "--train.steps=1", "--telemetry.probe_every=0"))
    with pytest.raises(StudyError, match="is an encoder \\(masked-LM\\) checkpoint; the study needs a causal decoder"):  # fmt: skip
        load_cell(arm_dir(tmp_path / "enc"))
    cells = _copy_cells(arm_dir(tmp_path / "enc").parent, tmp_path / "as_cell", "sigmoid")
    (cells / "sigmoid").rename(cells / "sig-rope")
    with pytest.raises(StudyError, match="is an encoder"):
        load_cells(cells)


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: shutil.rmtree(d / "checkpoints"), "no checkpoint"),
        (lambda d: _edit(d / "summary.json", lambda s: s.update(steps=10, status="interrupted")),
         "not finished \\(step 10 of train.steps=30, status interrupted\\)"),
        (lambda d: _edit(d / "summary.json", lambda s: s.update(status="diverged", divergence_step=9)),
         "diverged at step 9"),
    ],
)  # fmt: skip
def test_an_unfinished_cell_is_refused(trained, tmp_path, damage, match):
    _, run_dir, _ = trained
    d = _copy_cells(run_dir, tmp_path, "sig-g-nope")
    damage(d / "sig-g-nope")
    with pytest.raises(StudyError, match=match):
        load_cells(d)


def test_missing_cells_and_bad_windows_are_named(trained, tmp_path):
    cfg, run_dir, _ = trained
    with pytest.raises(StudyError, match="no such run dir"):
        load_cells(tmp_path / "nothing")
    d = _copy_cells(run_dir, tmp_path, "sm-rope")
    with pytest.raises(StudyError, match=r"no cell \['sm-g-rope'\] \(present: \['sm-rope'\]\)"):
        load_cells(d, ["sm-rope", "sm-g-rope"])
    with pytest.raises(C.ConfigError, match="config study.window: prefill \\+ window = 32 \\+ 40"):
        tiny(tmp_path, "--study.window=40")


def test_the_study_keys_never_block_a_resume():
    saved = C.to_dict(C.kv_tiny())
    current = C.to_dict(
        tiny("/unused", "--study.batch_size=3", "--study.probe_ps", "0.2",
             "--study.timing=False", "--study.timing_repeats=5")
    )  # fmt: skip
    assert config_changes(saved, current) == {}


@pytest.mark.parametrize(
    "script, files",
    [
        ("kv_support_removal", ["support_removal.csv", "support_removal.png"]),
        ("kv_row_sum", ["rowsum_binarization.csv"]),
        ("kv_gate_categories", ["table4_categories.csv"]),
    ],
)
def test_each_probe_script_runs_on_the_trained_cells(trained, tmp_path, monkeypatch, script, files):
    _, run_dir, _ = trained
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments" / "probes"))
    module = __import__(script)
    argv = [script, "--run", str(run_dir), "--out", str(tmp_path), "--windows", "2"]
    monkeypatch.setattr("sys.argv", argv)
    module.main()
    for f in files:
        assert (tmp_path / f).stat().st_size > 0, f


def test_pairs_group_each_gated_cell_with_its_backbone():
    from stabilitylab.eviction.pairs import cell_groups, child_argv

    groups = cell_groups(["sig-g-rope", "sm-rope", "sig-rope", "sig-nope", "sm-g-rope"])
    assert groups == [["sig-rope", "sig-g-rope"], ["sm-rope", "sm-g-rope"], ["sig-nope"]]
    argv = child_argv(["--preset", "tiny", "--cells", "sm-rope"], ["a", "b"], Path("/o"))
    assert argv[-6:] == [
        "--cells", "a", "b", "--study.parallel=False", "--study.timing=False", "--study.out_dir=/o"
    ]  # fmt: skip


def test_the_parallel_study_runs_one_process_per_pair_and_joins_them(tmp_path):
    """Two pairs and a lone dense cell in three processes, joined into one study."""
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}", "--train.steps=10", "--report=False",
            "--telemetry.val_every=5", *STUDY, "--study.parallel=True", "--study.timing_repeats=2",
            "--cells", "sm-rope", "sm-g-rope", "sig-rope", "sig-g-rope", "sig-nope"]  # fmt: skip
    assert kv_study_main(argv) == 0
    run_dir = tmp_path / "kv_tiny"
    assert sorted(p.name for p in run_dir.glob("study-*.log")) == [
        "study-sig-nope.log", "study-sig-rope.log", "study-sm-rope.log"
    ]  # fmt: skip
    t1 = pd.read_csv(run_dir / "study" / "table1.csv")
    assert sorted(t1["cell"]) == ["sig-g-rope", "sig-nope", "sig-rope", "sm-g-rope", "sm-rope"]
    assert sorted(pd.read_csv(run_dir / "study" / "table2.csv")["cell"]) == ["sig-g-rope", "sm-g-rope"]  # fmt: skip
    md = (run_dir / "study" / "study.md").read_text()
    assert "Merged from" in md and "decode_speed: timed after the study's tables were written" in md
    # The pairs' processes did not time; the parent timed every gated cell alone, after them.
    for child in ("study-sm-rope", "study-sig-rope", "study-sig-nope"):
        assert pd.read_csv(run_dir / child / "decode_speed.csv").empty, child
    speed = pd.read_csv(run_dir / "study" / "decode_speed.csv")
    assert sorted(speed["cell"]) == ["sig-g-rope", "sm-g-rope"]
    assert speed["measured_alone"].all() and (speed["repeats"] == 2).all()


# ---- per-window records, intervals, held-out text ---------------------------------------------


def test_every_evaluation_keeps_its_windows_and_they_add_up_to_the_tables(trained):
    _, run_dir, _ = trained
    w = pd.read_csv(run_dir / "study" / "windows.csv.gz")
    t1, t5 = read(run_dir, "table1").set_index("cell"), read(run_dir, "table5")
    # every cell at tau = 0 on test, every gated cell's val sweep point, tau*, test grid, baselines
    assert set(w.loc[w["role"] == "dense", "cell"]) == set(C.CELLS)
    val = w[(w["role"] == "sweep") & (w["text"] == "val")]
    assert len(val) == 4 * 15 * 2 and set(val["tau"]) == set(TAU_GRID)
    assert set(w["role"]) == {"dense", "sweep", "tau_star", "h2o", "keydiff", "h2o-even"}
    for cell, g in w[w["role"] == "dense"].groupby("cell"):
        assert math.exp(g["nll"].sum() / g["tokens"].sum()) == pytest.approx(
            t1.loc[cell, "test_ppl"]
        )
    for (cell, tau), g in val.groupby(["cell", "tau"]):
        row = t5[(t5["cell"] == cell) & (t5["tau"] == tau)]
        assert math.exp(g["nll"].sum() / g["tokens"].sum()) == pytest.approx(row["ppl"].item())
    assert (t1["test_ppl_lo"] <= t1["test_ppl"]).all() and (
        t1["test_ppl"] <= t1["test_ppl_hi"]
    ).all()


def test_the_comparisons_state_each_difference_with_its_interval(trained):
    _, run_dir, _ = trained
    cmp = read(run_dir, "comparisons")
    t1 = read(run_dir, "table1").set_index("cell")
    kinds = set(cmp["comparison"])
    assert {"tau0 gap", "eviction cost", "gate vs dense", "gate vs h2o", "gate vs keydiff",
            "gate vs h2o-even", "sigmoid vs softmax"} <= kinds  # fmt: skip
    gap = cmp[(cmp["comparison"] == "tau0 gap") & (cmp["a"] == "sig-g-rope (tau=0)")].iloc[0]
    assert gap["b"] == "sig-rope"
    want = t1.loc["sig-g-rope", "test_ppl"] - t1.loc["sig-rope", "test_ppl"]
    assert gap["diff"] == pytest.approx(want)
    assert (cmp["lo"] <= cmp["diff"] + 1e-12).all() and (cmp["diff"] <= cmp["hi"] + 1e-12).all()
    decided = cmp["verdict"] != "undecided"
    assert ((cmp["hi"] < 0) | (cmp["lo"] > 0))[decided].all()
    assert (cmp.loc[cmp["verdict"] == "a better", "diff"] < 0).all()
    sm = cmp[cmp["comparison"] == "sigmoid vs softmax"]
    assert set(sm["a"]) == {"sig-rope", "sig-nope", "sig-g-rope (tau=0)", "sig-g-nope (tau=0)"}
    md = (run_dir / "study" / "study.md").read_text()
    assert md.split("\n\n")[1].startswith("**Ran:** 8 cells")
    assert "nothing is evicted at this size" in md.split("\n\n")[1]  # tiny: tau* = 0 everywhere


def test_comparisons_of_disjoint_pairs_are_rebuilt_at_the_merge(evicting, tmp_path):
    """softmax and sigmoid sit in different processes of the parallel study: the merge compares
    them from the joined per-window records."""
    cells, inputs, result = evicting
    a = write_study(result.tables(), tmp_path / "sig")["study.md"].parent
    sm = {k: v for k, v in cells.items() if k in ("sm-rope",)}
    if not sm:
        sm = {"sm-rope": load_cell(cells["sig-rope"].dir.parent / "sm-rope")}
    other = run_study(sm, inputs, timing=False)
    b = write_study(other.tables(), tmp_path / "sm")["study.md"].parent
    assert "sigmoid vs softmax" not in set(pd.read_csv(a / "comparisons.csv")["comparison"])
    merged = pd.read_csv(merge_studies([a, b], tmp_path / "joined")["comparisons.csv"])
    row = merged[merged["comparison"] == "sigmoid vs softmax"]
    assert list(row["a"]) == ["sig-rope"] and list(row["b"]) == ["sm-rope"]


def test_a_step_matched_baseline_never_reads_more_than_the_gate(evicting):
    _, _, result = evicting
    o = result.gated["sig-g-rope"].texts["test"]
    for name in ("h2o", "keydiff"):
        assert o.baselines[name].keys_read == o.gate.keys_read
        assert (o.baselines[name].live_NL == o.gate.live_NL).all()
        assert o.baselines[name].budget.startswith("step-matched")
    even = o.baselines["h2o-even"]
    assert even.keys_read <= o.gate.keys_read and even.budget.startswith("even-matched")
    assert even.live_NL.sum() <= o.gate.live_NL.sum()


def _sample_shards_with(tmp_path, test_tokens) -> Path:
    """A shard folder holding ``test_tokens`` as its test split (train / val: one token)."""
    import hashlib

    d = tmp_path / "shards"
    d.mkdir()
    splits = {}
    for name, toks in (("train", [0]), ("val", [0]), ("test", test_tokens)):
        np.asarray(toks, dtype=np.uint16).tofile(d / f"{name}.bin")
        sha = hashlib.sha256((d / f"{name}.bin").read_bytes()).hexdigest()
        splits[name] = {"file": f"{name}.bin", "tokens": len(toks), "passages": 1, "sha256": sha}
    meta = {"format": 1, "dtype": "uint16", "vocab_size": 50257, "splits": splits,
            "tokenizer": {"name": "r50k_base"}}  # fmt: skip
    (d / "meta.json").write_text(json.dumps(meta))
    return d


def test_a_held_out_text_is_scored_at_the_frozen_tau_star(trained, evicting):
    """The held-out text here is the sample's own test split (offline): its rows must equal the
    test rows, tagged heldout, with tau* unchanged."""
    from stabilitylab.data.text.build import SAMPLE_DIR

    cfg, run_dir, _ = trained
    cells, _, _ = evicting
    held = tiny(run_dir.parent, *STUDY, f"--study.heldout_shards={SAMPLE_DIR}")
    inputs = study_inputs(held, cells, grid=EVICTING_GRID)
    res = run_study(cells, inputs, timing=False)
    t1, t2 = res.table1.set_index(["text", "cell"]), res.table2.set_index(["text", "cell"])
    assert set(res.table1["text"]) == {"test", "heldout"}
    assert t1.loc[("heldout", "sig-rope"), "test_ppl"] == pytest.approx(
        t1.loc[("test", "sig-rope"), "test_ppl"], rel=1e-12
    )
    assert (
        t2.loc[("heldout", "sig-g-rope"), "tau_star"] == t2.loc[("test", "sig-g-rope"), "tau_star"]
    )
    assert "heldout" in set(res.tables()["comparisons"]["text"])


def test_a_held_out_text_of_another_vocabulary_is_refused_before_any_evaluation(evicting, trained, tmp_path):  # fmt: skip
    cfg, run_dir, _ = trained
    cells, _, _ = evicting
    bad = _sample_shards_with(tmp_path, [50000, 3, 4] * 40)  # ids the tiny compact vocab lacks
    held = tiny(run_dir.parent, *STUDY, f"--study.heldout_shards={bad}")
    with pytest.raises(StudyError, match="held-out text .* compact vocabulary lacks"):
        study_inputs(held, cells, grid=EVICTING_GRID)
    with pytest.raises(C.ConfigError, match="study.heldout_shards: give study.heldout_files or"):
        tiny(run_dir.parent, "--study.heldout_files", "a.txt", f"--study.heldout_shards={bad}")


@pytest.mark.parametrize(
    "override,match",
    [
        ("--study.tau_rule=ratio", "study.tau_rule"),
        ("--study.max_delta_log_ppl=-0.1", "study.max_delta_log_ppl"),
        ("--study.max_delta_ppl=0", "study.max_delta_ppl"),
        ("--study.bootstrap=10", "study.bootstrap"),
        ("--study.baseline_windows=-1", "study.baseline_windows"),
    ],
)
def test_bad_study_keys_are_refused_by_name(tmp_path, override, match):
    with pytest.raises((C.ConfigError, SystemExit)) as e:
        tiny(tmp_path, override)
    if e.type is C.ConfigError:
        assert match in str(e.value)
