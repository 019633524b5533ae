"""analysis/kv_compare.py on synthetic study directories: rows side by side, spread over seeds."""

import math

import pandas as pd
import pytest

from stabilitylab.analysis.kv_compare import main, read_tables, spread, write_compare


def _study(root, run, ppl, tau):
    d = root / run / "study"
    d.mkdir(parents=True)
    pd.DataFrame({"cell": ["sig-rope", "sig-g-rope"], "test_ppl": [ppl, ppl + 1],
                  "train_val_ppl": [ppl * 2, ppl * 2]}).to_csv(d / "table1.csv", index=False)  # fmt: skip
    pd.DataFrame({"cell": ["sig-g-rope"], "tau_star": [tau], "test_ppl_tau_star": [ppl + 1.05],
                  "note": [float("nan")]}).to_csv(d / "table2.csv", index=False)  # fmt: skip
    return d


def test_spread_over_seeds_per_cell(tmp_path):
    dirs = [_study(tmp_path, "a", 50.0, 0.1), _study(tmp_path, "b", 52.0, 0.2)]
    t1 = read_tables(dirs, "table1")
    assert sorted(set(t1["run"])) == ["a", "b"] and len(t1) == 4
    sp = spread(t1).set_index("cell")
    assert sp.loc["sig-rope", "test_ppl_mean"] == 51.0
    assert math.isclose(sp.loc["sig-rope", "test_ppl_std"], 2**0.5)
    assert sp.loc["sig-g-rope", "n_runs"] == 2
    md = write_compare(dirs, tmp_path / "out").read_text()
    assert "51 ± 1.4" in md and "| sig-g-rope | b |" in md
    assert pd.read_csv(tmp_path / "out" / "table2_spread.csv")["tau_star_mean"].iloc[0] == 0.15


def test_one_run_per_cell_shows_rows_and_no_spread(tmp_path):
    d = _study(tmp_path, "a", 50.0, 0.1)
    md = write_compare([d], tmp_path / "out").read_text()
    assert "every run" in md and "mean ± std" not in md
    e = _study(tmp_path, "e", 60.0, 0.3)  # an ablation of the same cells: no mean over them
    main([str(d), str(e), "--no-spread", "--out", str(tmp_path / "abl")])
    assert "mean ± std" not in (tmp_path / "abl" / "compare.md").read_text()


def test_bad_inputs_are_named(tmp_path, capsys):
    d = _study(tmp_path, "a", 50.0, 0.1)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert "table1.csv is missing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="same run"):
        read_tables([d, d], "table1")


def test_labels_name_the_runs_and_must_match_the_directories(tmp_path, capsys):
    d, e = _study(tmp_path, "a", 50.0, 0.1), _study(tmp_path, "b", 52.0, 0.2)
    main([str(d), str(e), "--labels", "seed0", "seed1", "--out", str(tmp_path / "o")])
    runs = pd.read_csv(tmp_path / "o" / "table1_runs.csv")["run"]
    assert set(runs) == {"seed0", "seed1"}
    with pytest.raises(SystemExit):
        main([str(d), str(e), "--labels", "seed0", "--out", str(tmp_path / "p")])
    assert "1 labels for 2 study directories" in capsys.readouterr().err


def test_comparisons_over_seeds_get_a_t_interval_and_a_count_of_deciding_seeds(tmp_path):
    dirs = []
    for run, diffs in (("s0", (-1.0, 0.2)), ("s1", (-1.2, -0.1)), ("s2", (-0.8, 0.1))):
        d = _study(tmp_path, run, 50.0, 0.1)
        pd.DataFrame(
            {
                "text": ["test", "test"], "comparison": ["gate vs h2o", "tau0 gap"],
                "a": ["sig-g-rope (tau*)", "sig-g-rope (tau=0)"], "b": ["h2o on sig-rope", "sig-rope"],
                "diff": list(diffs), "lo": [diffs[0] - 0.3, diffs[1] - 0.5],
                "hi": [diffs[0] + 0.3, diffs[1] + 0.5],
                "verdict": ["a better", "undecided"], "n_windows": [10, 10],
            }
        ).to_csv(d / "comparisons.csv", index=False)  # fmt: skip
        dirs.append(d)
    md = write_compare(dirs, tmp_path / "out").read_text()
    seeds = pd.read_csv(tmp_path / "out" / "comparisons_seeds.csv").set_index("comparison")
    g = seeds.loc["gate vs h2o"]
    half = 4.303 * 0.2 / math.sqrt(3)  # std of (-1, -1.2, -0.8) is 0.2
    assert g["mean_diff"] == pytest.approx(-1.0)
    assert g["lo"] == pytest.approx(-1.0 - half) and g["hi"] == pytest.approx(-1.0 + half)
    assert g["verdict"] == "a better" and g["a_better_seeds"] == 3 and g["seeds"] == 3
    assert seeds.loc["tau0 gap", "verdict"] == "undecided"
    assert "## comparisons over the runs" in md
