"""One process per run directory: a second process on a busy arm, cell or study folder exits 2
with one ``error:`` line naming the holder, before it writes anything; the lock goes with its
process however it ends, and one left by a killed process is taken over."""

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stabilitylab import runlock
from stabilitylab.cli import kv_study_main, train_main
from tests.tiny_runs import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
HOLD = (
    "import sys; from stabilitylab import runlock\n"
    "with runlock.hold(sys.argv[1:]):\n"
    "    print('held', flush=True); sys.stdin.read()\n"
)


def holding(*dirs: Path) -> subprocess.Popen:
    """Another process that holds the locks of ``dirs`` until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, *map(str, dirs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline() == "held\n"
    return proc


def refused(capsys, main, argv) -> str:
    """The one stderr line of ``main(argv)``, which must exit 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_a_second_process_on_a_busy_arm_exits_2_naming_the_holder(tmp_path, capsys):
    arm = tmp_path / "smoke" / "sigmoid"
    proc = holding(arm)
    try:
        argv = ["--preset", "smoke", f"--out_dir={tmp_path}", *TINY, "--train.steps=1"]
        line = refused(capsys, train_main, argv)
    finally:
        proc.stdin.close()
        proc.wait()
    assert line.startswith(f"error: {arm} is in use by pid {proc.pid} on host ")
    assert " since 20" in line
    # Nothing was written: not the softmax arm (free, but the run is refused as a whole), not the
    # busy one; the folders the locks made went with them.
    assert list(tmp_path.iterdir()) == []


def test_a_busy_cell_or_study_folder_refuses_the_kv_study(tmp_path, capsys):
    run_dir = tmp_path / "kv_tiny"
    argv = ["--preset", "tiny", f"--out_dir={tmp_path}", "--cells", "sm-rope", "--train.steps=1"]
    for busy in (run_dir / "sm-rope", run_dir / "study"):
        proc = holding(busy)
        try:
            line = refused(capsys, kv_study_main, argv)
        finally:
            proc.stdin.close()
            proc.wait()
        assert line.startswith(f"error: {busy} is in use by pid {proc.pid} ")
        assert not (run_dir / "sm-rope").exists() and not (run_dir / "study").exists()


def test_a_run_lets_go_of_its_lock_when_it_ends(tmp_path):
    argv = ["--preset", "smoke", f"--out_dir={tmp_path}", *TINY, "--arm=sigmoid", "--train.steps=1"]
    assert train_main(argv) == 0
    lock = tmp_path / "smoke" / "sigmoid.lock"
    assert not lock.exists() and runlock._held == {}
    proc = holding(tmp_path / "smoke" / "sigmoid")  # another process can take it
    proc.stdin.close()
    assert proc.wait() == 0


def test_an_exception_lets_go_of_the_lock(tmp_path):
    d = tmp_path / "run" / "softmax"
    with pytest.raises(RuntimeError), runlock.hold([d]):
        raise RuntimeError("a bug in the run")
    lock = runlock.lock_path(d)
    assert not lock.exists() and not lock.parent.exists(), "the folder it made went too"
    lock.parent.mkdir(parents=True)
    with open(lock, "w") as f:  # a plain flock of another open file succeeds: nothing holds it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_the_lock_of_a_killed_process_is_taken_over(tmp_path, capsys):
    d = tmp_path / "run" / "softmax"
    proc = holding(d)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stale = json.loads(runlock.lock_path(d).read_text())
    assert stale["pid"] == proc.pid, "the killed holder's record is left behind"
    with runlock.hold([d]):
        assert runlock.holder(runlock.lock_path(d))["pid"] == os.getpid()
    assert f"taking over the lock of pid {proc.pid}" in capsys.readouterr().err


def test_a_half_written_record_still_names_a_busy_lock(tmp_path):
    d = tmp_path / "run" / "softmax"
    proc = holding(d)
    try:
        runlock.lock_path(d).write_text('{"pid": 1')  # a reader can meet a record mid-write
        with pytest.raises(runlock.RunBusy, match="in use by another process"):
            runlock.acquire(d)
    finally:
        proc.stdin.close()
        proc.wait()


def test_locks_are_reentrant_within_a_process(tmp_path):
    d = tmp_path / "run" / "cell"
    with runlock.hold([d]):
        with runlock.hold([d]):  # the KV study holds its cells, then the training takes them
            pass
        assert runlock.lock_path(d).exists(), "the outer hold still holds it"
    assert not runlock.lock_path(d).exists()
