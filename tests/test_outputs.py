"""No command dirties the checkout: a script's default output goes under runs/ (git-ignored),
never into the tracked results/ that the docs cite (refreshed on purpose, with --out)."""

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SMALL = {
    "score_map.py": ["--ns", "4", "--scales", "1", "--rows", "1"],
    "attention_layer.py": [
        "--n",
        "4",
        "--scales",
        "0.5",
        "2",
        "--ns",
        "4",
        "8",
        "--draws",
        "1",
        "--dim",
        "4",
        "--scale-ranges",
        "0.4:3",
    ],  # fmt: skip
    "estimator_check.py": ["--ns", "4", "--scales", "1", "--iters", "2"],
}


@pytest.mark.parametrize("script", sorted(SMALL))
def test_a_probe_script_writes_under_runs_by_default(script, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative defaults resolve here, as in a checkout's root
    monkeypatch.setattr(sys, "argv", [script, *SMALL[script]])
    runpy.run_path(str(ROOT / "experiments" / "probes" / script), run_name="__main__")
    stem = script.removesuffix(".py")
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [f"runs/probes/{stem}.csv", f"runs/probes/{stem}.png"]


def test_no_script_defaults_into_results():
    """Every ``--out`` default of a script under experiments/ and analysis/ (the probe scripts'
    was results/probes, fast_vs_eager's results/bench/...)."""
    scripts = [*ROOT.glob("experiments/**/*.py"), *ROOT.glob("analysis/*.py")]
    offenders = [
        str(p.relative_to(ROOT))
        for p in scripts
        if 'default=Path("results' in p.read_text() or 'default="results' in p.read_text()
    ]
    assert offenders == []
