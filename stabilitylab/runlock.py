"""Exclusive locks on run directories: one process at a time per arm (or cell) dir and per study
folder, so that two runs under one name never write into the same files.

    with hold([Path("runs/smoke/softmax"), Path("runs/smoke/sigmoid")]):
        ...                                    # RunBusy (naming the holder) if another has one

The lock of a directory ``D`` is the file ``D.lock`` beside it (``runs/smoke/softmax.lock``:
beside, not inside, because ``--fresh=True`` deletes ``D``), locked with ``flock(2)``. The
kernel drops an flock when its process ends, however it ends (normal return, exception, a
signal, SIGKILL, a crash), so a lock file left by a killed process holds no lock: the next run
takes it over and says so. While held, the file records the holder (pid, host, start time,
command) for the message of a process that finds it busy. A clean release deletes the file; the
acquirer checks after locking that the file it locked is still the one at the path, so a delete
racing with a new acquire never lets two processes both hold a lock.

Within one process the locks are re-entrant (the KV study holds its cells across the training,
which takes them again, and the study). On a filesystem shared between machines, ``flock``
works where the filesystem supports it (NFSv4 maps it to a byte-range lock).

Hand-written on ``fcntl`` rather than the ``filelock`` package: that one truncates the file when
it tries a lock, which would erase the holder's record that the busy message reads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


class RunBusy(Exception):
    """Another process holds the lock of a run directory; the message names it."""


_held: dict[Path, list] = {}
"""Locks this process holds: lock file -> [fd, depth, folders made for it]."""


def lock_path(d: str | Path) -> Path:
    """The lock file of directory ``d``: ``d.lock`` beside it."""
    d = Path(d).absolute()
    return d.with_name(d.name + ".lock")


def holder(path: str | Path) -> dict | None:
    """The holder a lock file records (pid, host, started, command), or None (no file, empty,
    or half written)."""
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def describe(info: dict | None) -> str:
    """``pid 123 on host gpu1 since 2026-12-03T10:00:00+0000 (python experiments/...)``."""
    if not info:
        return "another process (its record is unreadable)"
    return (
        f"pid {info.get('pid')} on host {info.get('host')} since {info.get('started')} "
        f"({info.get('command')})"
    )


def _record() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }


def _open_locked(path: Path, d: Path) -> int:
    """An fd of ``path`` that holds its flock, the file being the one at the path (retried
    when a releasing holder deleted it between our open and our lock)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            raise RunBusy(
                f"{d} is in use by {describe(holder(path))}: two runs in one directory would "
                f"mix their files; wait for it to end, stop it, or pick another --name "
                f"(lock file {path})"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def acquire(d: str | Path) -> None:
    """Hold the lock of directory ``d`` (re-entrant in this process); RunBusy if another
    process holds it. A record left by a process that no longer holds it is taken over, with a
    note on stderr."""
    path = lock_path(d)
    if path in _held:
        _held[path][1] += 1
        return
    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = _open_locked(path, Path(d))
    except RunBusy:
        _remove_empty(made)
        raise
    stale = holder(path)
    if stale:
        print(
            f"note: {path}: taking over the lock of {describe(stale)}, which no longer holds it",
            file=sys.stderr,
            flush=True,
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_record()).encode(), 0)
    os.fsync(fd)
    _held[path] = [fd, 1, made]


def release(d: str | Path) -> None:
    """Let go of ``d``'s lock (the file is deleted when the outermost hold ends)."""
    path = lock_path(d)
    entry = _held.get(path)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    del _held[path]
    # Delete before unlocking: a process waiting on this inode then sees it is not the path's
    # file any more and opens the path anew.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(entry[0])  # closing the last fd drops the flock
    _remove_empty(entry[2])


def _remove_empty(folders: list[Path]) -> None:
    """The folders a lock made, deepest first, where nothing else went into them: a run refused
    before any work (bad data, a busy arm) leaves no empty <out_dir>/<name>/ behind."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (the run wrote there, or another process did): keep it
            return


@contextlib.contextmanager
def hold(dirs: Iterable[str | Path]) -> Iterator[None]:
    """Hold every lock of ``dirs`` for the block, or none: RunBusy for the first one busy,
    before the block runs (the locks taken so far are let go)."""
    taken: list[Path] = []
    try:
        for d in dirs:
            acquire(d)
            taken.append(Path(d))
        yield
    finally:
        for d in reversed(taken):
            release(d)
