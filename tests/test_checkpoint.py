"""Checkpoints: a kill at any moment of a write still resumes bit for bit (dropout on); a damaged
checkpoint stops the resume with an error naming the file."""

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from stabilitylab.cli import USAGE_ERROR, train_main
from stabilitylab.train import checkpoint, run
from stabilitylab.train.checkpoint import CheckpointError, read_state
from tests.tiny_runs import TINY, arm_dir
from tests.tiny_runs import tiny as tiny_run

ROOT = Path(__file__).resolve().parent.parent

# tests/tiny_runs.py's run with dropout on: its draws are what a checkpoint's RNG state must carry.
DROPOUT = "--model.dropout=0.1"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(out_dir, *overrides):
    return tiny_run(out_dir, DROPOUT, *overrides)


class Killed(BaseException):
    """What SIGKILL does to the trainer, raised at a chosen moment of a checkpoint write: nothing
    after it runs (a BaseException passes every ``except Exception``)."""


class KillSwitch:
    """Numbers the file-system moments of the ``save_no``-th write of ``last`` (before, during
    and after each file write, rename and delete) and raises :class:`Killed` at ``kill_at``;
    with ``kill_at=None`` it only records them."""

    def __init__(self, monkeypatch, save_no: int, kill_at: int | None):
        self.save_no, self.kill_at = save_no, kill_at
        self.saves, self.moments, self.active = 0, [], False
        real = {
            "save": checkpoint.save,
            "torch_save": torch.save,
            "rename": checkpoint.os.rename,
            "rmtree": checkpoint.shutil.rmtree,
            "dump": checkpoint.json.dump,
        }
        self.real = real

        def save(ckpt_dir, name, *args, **kwargs):
            if name == checkpoint.LAST:
                self.saves += 1
                self.active = self.saves == self.save_no
            try:
                return real["save"](ckpt_dir, name, *args, **kwargs)
            finally:
                self.active = False

        monkeypatch.setattr(checkpoint, "save", save)
        monkeypatch.setattr(
            torch, "save", self._wrap("torch.save", real["torch_save"], self._cut_file)
        )
        monkeypatch.setattr(checkpoint.os, "rename", self._wrap("rename", real["rename"], None))
        monkeypatch.setattr(
            checkpoint.shutil, "rmtree", self._wrap("rmtree", real["rmtree"], self._cut_tree)
        )
        monkeypatch.setattr(
            checkpoint.json, "dump", self._wrap("manifest", real["dump"], self._cut_json)
        )

    def _moment(self, label: str) -> bool:
        """Record a moment; True when the kill falls on it."""
        if not self.active:
            return False
        self.moments.append(label)
        return len(self.moments) == self.kill_at

    def _wrap(self, what, fn, cut):
        def wrapped(*args, **kwargs):
            if self._moment(f"before {what}"):
                raise Killed
            if cut is not None and self._moment(f"during {what}"):
                cut(*args)
                raise Killed
            out = fn(*args, **kwargs)
            if self._moment(f"after {what}"):
                raise Killed
            return out

        return wrapped

    def _cut_file(self, obj, path, *_):
        buf = io.BytesIO()
        self.real["torch_save"](obj, buf)
        Path(path).write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])

    def _cut_tree(self, path, *_):
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        if files:
            files[0].unlink()

    def _cut_json(self, obj, fh, *_):
        fh.write(json.dumps(obj)[:40])
        fh.flush()


STEPS = ["--train.steps=8", "--train.checkpoint_every=2"]  # writes of `last` at steps 2, 4, 6, 8


def test_a_kill_at_any_moment_of_a_checkpoint_write_resumes_bit_for_bit(tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        probe = KillSwitch(m, save_no=2, kill_at=None)
        run(tiny(tmp_path / "straight", *STEPS))
    straight = read_state(arm_dir(tmp_path / "straight") / "checkpoints" / "last")
    assert len(probe.moments) >= 14, probe.moments  # 3 files, 2 renames, 1 delete
    resumed_at = set()
    for k, moment in enumerate(probe.moments, start=1):
        out = tmp_path / f"kill{k}"
        with monkeypatch.context() as m:
            KillSwitch(m, save_no=2, kill_at=k)
            with pytest.raises(Killed):
                run(tiny(out, *STEPS))
        run(tiny(out, *STEPS))
        prov = json.loads((arm_dir(out) / "provenance.json").read_text())
        resumed_at.add(prov["resumes"][0]["step"])
        b = read_state(arm_dir(out) / "checkpoints" / "last")
        assert b["step"] == 8, moment
        assert b["history"]["loss"] == straight["history"]["loss"], f"killed {moment}"
        assert b["history"]["grad_norm"] == straight["history"]["grad_norm"], f"killed {moment}"
        for name, t in straight["model"].items():
            assert torch.equal(t, b["model"][name]), (moment, name)
        leftovers = sorted(p.name for p in (arm_dir(out) / "checkpoints").iterdir())
        assert leftovers == ["last"], (moment, leftovers)
    assert resumed_at == {2, 4}, "kills before the commit resume at step 2, after it at step 4"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    run(tiny(out, "--train.steps=4", "--train.checkpoint_every=2"))
    torch.set_num_threads(n)
    return out


def damaged_copy(src, tmp_path) -> Path:
    """A copy of a finished run that a rerun with more steps would resume."""
    out = tmp_path / "copy"
    shutil.copytree(src, out)
    return out


@pytest.mark.parametrize(
    "damage, named",
    [
        (lambda last: last.joinpath("rng0.pt").write_bytes(b"PK\x03\x04cut"), "rng0.pt is corrupt"),
        (lambda last: last.joinpath("state.pt").unlink(), "state.pt is missing"),
        (lambda last: last.joinpath("manifest.json").write_text("{"), "manifest.json is missing"),
    ],
    ids=["rng-truncated", "state-missing", "manifest-cut"],
)
def test_a_damaged_checkpoint_stops_the_resume_naming_the_file(
    finished_run, tmp_path, damage, named
):
    out = damaged_copy(finished_run, tmp_path)
    damage(arm_dir(out) / "checkpoints" / "last")
    with pytest.raises(CheckpointError, match=named) as e:
        run(tiny(out, "--train.steps=6"))
    assert str(arm_dir(out) / "checkpoints" / "last") in str(e.value)


def test_the_script_reports_a_damaged_checkpoint_in_one_line(finished_run, tmp_path, capsys):
    out = damaged_copy(finished_run, tmp_path)
    (arm_dir(out) / "checkpoints" / "last" / "rng0.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as exit_info:
        train_main(
            [
                "--preset",
                "smoke",
                "--arm=sigmoid",
                f"--out_dir={out}",
                *TINY,
                DROPOUT,
                "--train.steps=6",
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == USAGE_ERROR
    assert err[-1].startswith("error: checkpoint file ") and "rng0.pt is corrupt" in err[-1]


def test_a_checkpoint_of_the_older_single_file_layout_is_refused(finished_run, tmp_path):
    out = damaged_copy(finished_run, tmp_path)
    ckpt = arm_dir(out) / "checkpoints"
    shutil.rmtree(ckpt / "last")
    (ckpt / "last.pt").write_bytes(b"old")
    with pytest.raises(CheckpointError, match="last.pt is a checkpoint of an older layout"):
        run(tiny(out, "--train.steps=6"))
    assert (ckpt / "last.pt").read_bytes() == b"old", "the old checkpoint is left alone"


def test_every_checkpoint_file_loads_with_weights_only(finished_run):
    last = arm_dir(finished_run) / "checkpoints" / "last"
    manifest = json.loads((last / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["rng0.pt", "state.pt"] and manifest["step"] == 4
    for name in manifest["files"]:
        torch.load(last / name, weights_only=True)
    assert manifest["config"]["arm"] == "sigmoid"
