"""How a rerun meets the run on disk: resume, refuse a changed config, force, start fresh, or
leave a finished run untouched; plus what the run dir records (vocabulary, precision, trackers)."""

import json
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from stabilitylab import config as C
from stabilitylab import tags
from stabilitylab.analysis.events import load_runs
from stabilitylab.data.source import CellSource
from stabilitylab.train import build, loop, run
from stabilitylab.train.checkpoint import read_state
from stabilitylab.train.resume import ResumeError, config_changes
from tests.tiny_runs import arm_dir, tiny

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def test_a_changed_config_is_refused_naming_the_keys(tmp_path):
    run(tiny(tmp_path, "--train.steps=4"))
    before = snapshot(arm_dir(tmp_path))
    with pytest.raises(ResumeError, match=r"train\.lr: 0\.003 -> 0\.01(?!\d)") as e:
        run(tiny(tmp_path, "--train.steps=6", "--train.lr=0.01", "--model.dropout=0.1"))
    assert "model.dropout: 0.0 -> 0.1" in str(e.value) and "train.steps" not in str(e.value)
    assert snapshot(arm_dir(tmp_path)) == before, "a refused resume writes nothing"


def test_force_resumes_with_the_new_values_and_records_the_change(tmp_path):
    run(tiny(tmp_path, "--train.steps=4"))
    s = run(tiny(tmp_path, "--train.steps=6", "--train.lr=0.01", "--resume=force"))["sigmoid"]
    d = arm_dir(tmp_path)
    assert s["steps"] == 6 and s["peak_lr"] == 0.01
    assert json.loads((d / "config.json").read_text())["train"]["lr"] == 0.003, "the start's"
    resumes = json.loads((d / "provenance.json").read_text())["resumes"]
    assert [r["step"] for r in resumes] == [4]
    assert resumes[0]["config_changes"] == {"train.lr": [0.003, 0.01]}
    # The checkpoint now holds the new values: the next rerun with them needs no force.
    s = run(tiny(tmp_path, "--train.steps=7", "--train.lr=0.01"))["sigmoid"]
    assert s["steps"] == 7
    with pytest.raises(ResumeError, match=r"train\.lr: 0\.01 -> 0\.003"):
        run(tiny(tmp_path, "--train.steps=8"))


def test_fresh_starts_over_and_leaves_nothing_of_the_old_run(tmp_path):
    run(tiny(tmp_path, "--train.steps=8"))
    s = run(tiny(tmp_path, "--train.steps=3", "--fresh=True", "--train.lr=0.01"))["sigmoid"]
    d = arm_dir(tmp_path)
    assert s["steps"] == 3 and len(list(d.glob("events.out.tfevents.*"))) == 1
    df = load_runs([d])
    loss = df[df.tag == tags.LOSS]
    assert sorted(loss.step) == [0, 1, 2], "no point of the old run"
    assert read_state(d / "checkpoints" / "last")["step"] == 3
    assert "resumes" not in json.loads((d / "provenance.json").read_text())


def test_an_ended_run_without_its_checkpoint_is_refused_not_deleted(tmp_path):
    run(tiny(tmp_path, "--train.steps=3"))
    shutil.rmtree(arm_dir(tmp_path) / "checkpoints" / "last")
    before = snapshot(arm_dir(tmp_path))
    with pytest.raises(ResumeError, match="ended at step 3 and no checkpoint"):
        run(tiny(tmp_path, "--train.steps=6"))
    assert snapshot(arm_dir(tmp_path)) == before


def test_fresh_and_force_together_are_refused():
    with pytest.raises(C.ConfigError, match="fresh"):
        run(tiny("/nonexistent", "--fresh=True", "--resume=force"))


def test_rerunning_a_finished_run_rewrites_nothing(tmp_path):
    first = run(tiny(tmp_path, "--train.steps=4"))["sigmoid"]
    before = snapshot(arm_dir(tmp_path))
    again = run(tiny(tmp_path, "--train.steps=4"))["sigmoid"]
    assert again == json.loads(json.dumps(first)) and again["wall_time_s"] == first["wall_time_s"]
    assert snapshot(arm_dir(tmp_path)) == before


def test_wall_time_adds_up_across_resumes(tmp_path, monkeypatch):
    clock = {"t": 0.0}

    def fake_time():  # every reading of the wall clock is 100 s after the previous one
        clock["t"] += 100.0
        return clock["t"]

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(time=fake_time, perf_counter=_perf))
    first = run(tiny(tmp_path, "--train.steps=4"))["sigmoid"]
    second = run(tiny(tmp_path, "--train.steps=5"))["sigmoid"]
    assert first["wall_time_s"] >= 100.0
    assert second["wall_time_s"] >= first["wall_time_s"] + 100.0


def _perf():
    import time

    return time.perf_counter()


def _purge_markers(event_file: Path) -> list[int]:
    return [
        e.step
        for e in EventFileLoader(str(event_file)).Load()
        if e.HasField("session_log") and e.session_log.status == e.session_log.START
    ]


def test_a_resumed_run_purges_tensorboard_from_the_resume_step(tmp_path):
    run(tiny(tmp_path, "--train.steps=4", "--train.checkpoint_every=2"))
    run(tiny(tmp_path, "--train.steps=6"))
    files = sorted(arm_dir(tmp_path).glob("events.out.tfevents.*"))
    assert len(files) == 2
    assert _purge_markers(files[0]) == [] and _purge_markers(files[1]) == [4]


class NamedGenes(CellSource):
    """A stand-in for an .h5ad file: 40 named genes, whatever data.n_genes says."""

    n_genes = 40
    gene_names = [f"GENE{i}" for i in range(40)]
    context_len = 32

    def __len__(self) -> int:
        return 100

    def cell(self, index: int) -> np.ndarray:
        rng = np.random.default_rng(index)
        return rng.permutation(self.n_genes)[: rng.integers(8, 30)].astype(np.int64)


def test_the_run_dir_records_the_sources_vocabulary(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "build_source", lambda cfg, seed: NamedGenes())
    run(tiny(tmp_path, "--train.steps=2"))
    d = arm_dir(tmp_path)
    assert json.loads((d / "config.json").read_text())["data"]["n_genes"] == 40
    vocab = json.loads((d / "vocab.json").read_text())
    assert vocab["genes"] == NamedGenes.gene_names and vocab["gene_token_offset"] == 3
    assert vocab["special_tokens"] == {"<pad>": 0, "<mask>": 1, "<cls>": 2}
    model = read_state(d / "checkpoints" / "last")["model"]
    assert model["tok_emb.weight"].shape[0] == 40 + C.N_SPECIAL_TOKENS


def test_config_changes_ignore_what_does_not_change_training():
    base = {"train": {"lr": 1.0, "steps": 5}, "telemetry": {"log_every": 1}, "report": True}
    other = {"train": {"lr": 1.0, "steps": 9}, "telemetry": {"log_every": 7}, "report": False}
    assert config_changes(base, other) == {}
    assert config_changes(base, {**other, "backend": "x"}) == {"backend": ["<absent>", "x"]}


def test_the_launchers_mixed_precision_wins_over_train_precision(monkeypatch):
    cfg = C.parse(["--preset", "smoke", "--train.precision=bf16"])
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert build.mixed_precision(cfg, cuda=False) == ("bf16", "train.precision")
    assert build.mixed_precision(C.parse(["--preset", "smoke"]), cuda=True)[0] == "bf16"
    assert build.mixed_precision(C.parse(["--preset", "smoke"]), cuda=False)[0] == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert build.mixed_precision(cfg, cuda=True)[0] == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(C.ConfigError, match="'fp16'"):
        build.mixed_precision(cfg, cuda=True)


def test_a_tracker_that_is_not_installed_is_refused_before_any_work(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)

    def no_data(*_):
        raise AssertionError("data built before the config was checked")

    monkeypatch.setattr(loop, "build_source", no_data)
    cfg = tiny("/nonexistent", "--trackers", "wandb")
    assert cfg.trackers == ["wandb"]
    with pytest.raises(C.ConfigError, match="config trackers: wandb not installed"):
        run(cfg)
