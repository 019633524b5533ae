"""Run directories -> one tidy DataFrame of scalars (run, arm, step, tag, value).

Accepted paths: an arm dir (``<out>/<name>/<arm>/`` with ``events.out.tfevents.*`` in it), a
paired run (``<out>/<name>/`` with one arm dir per arm), or any folder above them (searched
recursively; ``checkpoints/`` and report folders hold no event files and are skipped).

Event files are read with TensorBoard's own record reader. A file that is still being written,
or was cut mid-record by a crash, is read up to its last whole record; one warning lists every
such file. When a resumed run logged a step twice (in one file or across files), the value
written last wins. Tags are parsed only through templates from ``stabilitylab.tags``.
"""

from __future__ import annotations

import json
import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2
from tensorboard.util import tensor_util

from stabilitylab import tags

EVENT_GLOB = "events.out.tfevents.*"
COLUMNS = ["run", "arm", "step", "tag", "value"]
_NOT_ARM_DIRS = {"checkpoints", "report"}  # folders inside a run that are never an arm
_RECORD_OVERHEAD = 16  # TFRecord framing: u64 length, u32 crc(length), payload, u32 crc(payload)
_NUMERIC_SUMMARY_FIELDS = (
    "max_grad_norm",
    "max_logit",
    "wall_time_s",
    "initial_loss",
    "final_loss",
)


class TruncatedEventsWarning(UserWarning):
    """An event file ended inside a record (run still writing, or crashed); the rest was kept."""


def read_event_file(path: str | Path) -> tuple[list[tuple[int, str | None, float]], bool]:
    """Scalars of one event file as ``(step, tag, value)`` in file order, and whether it was cut.

    A row ``(step, None, nan)`` marks a purge: a writer opened with ``purge_step=step`` (a resumed
    run) asks readers to drop what earlier files logged at ``step`` and later (``apply_purges``).
    A file is cut when the whole records read do not account for its size: TensorBoard's reader
    stops silently at a partial or corrupt record, so the byte count is the only way to tell.
    """
    path = Path(path)
    size = path.stat().st_size
    consumed = 0
    rows: list[tuple[int, str, float]] = []
    for record in RawEventFileLoader(str(path)).Load():
        consumed += len(record) + _RECORD_OVERHEAD
        event = event_pb2.Event.FromString(record)
        if _is_purge(event):
            rows.append((int(event.step), None, float("nan")))
        if not event.HasField("summary"):
            continue
        for v in event.summary.value:
            value = _scalar(v)
            if value is not None:
                rows.append((int(event.step), v.tag, value))
    return rows, consumed < size


def _is_purge(event) -> bool:
    """TensorBoard's restart marker: the log of a writer opened with ``purge_step``."""
    log = getattr(event, "session_log", None)  # the protobuf's field name
    return event.HasField("session_log") and log.status == log.START


def apply_purges(rows: list[tuple[int, str | None, float]]) -> list[tuple[int, str, float]]:
    """Rows in file order with every purge applied: a marker at step s drops the rows before it
    whose step is >= s (what a killed run logged past its last checkpoint), as TensorBoard does."""
    kept: list[tuple[int, str, float]] = []
    for step, tag, value in rows:
        if tag is None:
            kept = [r for r in kept if r[0] < step]
        else:
            kept.append((step, tag, value))
    return kept


def _scalar(v) -> float | None:
    """A summary value as a float, or None when it is not a scalar (histogram, image, ...)."""
    kind = v.WhichOneof("value")
    if kind == "simple_value":
        return float(v.simple_value)
    if kind == "tensor":
        arr = tensor_util.make_ndarray(v.tensor)
        if arr.size == 1 and np.issubdtype(arr.dtype, np.number):
            return float(arr.reshape(()))
    return None


def find_arm_dirs(path: str | Path, *, with_meta_only: bool = False) -> list[Path]:
    """Arm dirs (folders holding event files) at or under ``path``, sorted.

    ``with_meta_only`` adds arm dirs that hold config.json or summary.json but no event file
    (a run that never logged, or whose event file was removed), so a report can say so.
    Raises FileNotFoundError when ``path`` does not exist, ValueError when nothing under it
    holds an event file (or, with ``with_meta_only``, an arm's json either).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"run directory not found: {root}")
    if not root.is_dir():
        raise ValueError(f"not a directory: {root}")
    found = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _NOT_ARM_DIRS]
        if any(Path(dirpath, f).match(EVENT_GLOB) for f in files) or (
            with_meta_only and {"config.json", "summary.json"} & set(files)
        ):
            found.append(Path(dirpath))
    if not found:
        raise ValueError(f"no TensorBoard event files ({EVENT_GLOB}) in or under {root}")
    return sorted(found)


def load_arm(arm_dir: str | Path, run: str, arm: str) -> tuple[pd.DataFrame, list[Path]]:
    """Tidy scalars of one arm dir, and the event files found cut short."""
    arm_dir = Path(arm_dir)
    files = sorted(arm_dir.glob(EVENT_GLOB))
    if not files:
        raise ValueError(f"no TensorBoard event files ({EVENT_GLOB}) in {arm_dir}")
    # File names start with the creation time, so sorting by name puts a resumed run's file last.
    rows: list[tuple[int, str, float]] = []
    cut: list[Path] = []
    for f in files:
        file_rows, truncated = read_event_file(f)
        rows.extend(file_rows)
        if truncated:
            cut.append(f)
    df = pd.DataFrame(apply_purges(rows), columns=["step", "tag", "value"])
    df = df.drop_duplicates(subset=["tag", "step"], keep="last")
    df.insert(0, "run", run)
    df.insert(1, "arm", arm)
    df = df.astype({"run": str, "arm": str, "step": np.int64, "tag": str, "value": np.float64})
    return df.sort_values(["tag", "step"], kind="stable").reset_index(drop=True), cut


def arm_name(arm_dir: Path) -> str:
    """The arm from config.json, else summary.json, else the folder name."""
    for meta in (load_config(arm_dir), load_summary(arm_dir)):
        if meta and isinstance(meta.get("arm"), str):
            return meta["arm"]
    return arm_dir.name


def _labels(arm_dirs: list[Path]) -> list[tuple[str, str]]:
    """(run, arm) per arm dir: run = the parent's name for a dir named after its arm.

    Two dirs that would share a label get longer run names (more parent folders) until unique.
    """
    arms = [arm_name(d) for d in arm_dirs]
    bases = [d.parent if d.name == a else d for d, a in zip(arm_dirs, arms, strict=True)]
    depth = 1
    while True:
        runs = ["/".join(b.resolve().parts[-depth:]) for b in bases]
        pairs = list(zip(runs, arms, strict=True))
        if len(set(pairs)) == len(pairs) or depth > 64:
            return pairs
        depth += 1


def discover(
    paths: list[str | Path] | str | Path, *, with_meta_only: bool = False
) -> list[tuple[Path, str, str]]:
    """``(arm_dir, run, arm)`` for every arm dir in or under ``paths``, unique labels.

    ``with_meta_only``: also arm dirs without an event file (see ``find_arm_dirs``).
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("no run directories given")
    arm_dirs: list[Path] = []
    for p in paths:
        for d in find_arm_dirs(p, with_meta_only=with_meta_only):
            if d.resolve() not in {a.resolve() for a in arm_dirs}:
                arm_dirs.append(d)
    return [(d, run, arm) for d, (run, arm) in zip(arm_dirs, _labels(arm_dirs), strict=True)]


def load_runs(paths: list[str | Path] | str | Path) -> pd.DataFrame:
    """All scalars of the runs in ``paths`` as a tidy DataFrame with columns ``COLUMNS``.

    ``step`` is int64 and ``value`` float64 (NaN and inf kept as logged); rows are sorted by
    run, arm, tag and step, one row per (run, arm, tag, step). Reading costs ~60 us per scalar
    (TensorBoard's pure-Python record reader checks a CRC per record).
    """
    return load_found(discover(paths))


def read_found(found: list[tuple[Path, str, str]]) -> tuple[pd.DataFrame, list[Path]]:
    """The tidy scalars of ``found`` and the event files cut mid-record, without a warning.

    An arm dir without an event file contributes no rows.
    """
    frames, cut = [pd.DataFrame(columns=COLUMNS)], []
    for arm_dir, run, arm in found:
        if not any(Path(arm_dir).glob(EVENT_GLOB)):
            continue
        df, arm_cut = load_arm(arm_dir, run, arm)
        frames.append(df)
        cut.extend(arm_cut)
    out = pd.concat([f for f in frames if not f.empty] or frames[:1], ignore_index=True)
    out = out.astype({"run": str, "arm": str, "step": np.int64, "tag": str, "value": np.float64})
    return out.sort_values(["run", "arm", "tag", "step"], kind="stable").reset_index(drop=True), cut


def cut_message(cut: list[Path]) -> str:
    return (
        "event file(s) cut mid-record (still being written, or crashed); kept the records "
        "before the cut: " + ", ".join(str(f) for f in cut)
    )


def load_found(found: list[tuple[Path, str, str]]) -> pd.DataFrame:
    """``load_runs`` for the ``(arm_dir, run, arm)`` list that ``discover`` returned.

    One ``TruncatedEventsWarning`` lists every event file cut mid-record.
    """
    df, cut = read_found(found)
    if cut:
        warnings.warn(cut_message(cut), TruncatedEventsWarning, stacklevel=3)
    return df


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def load_config(arm_dir: str | Path) -> dict | None:
    """The resolved config.json of an arm dir, or None if absent."""
    return _read_json(Path(arm_dir) / "config.json")


def load_summary(arm_dir: str | Path) -> dict | None:
    """summary.json of an arm dir (None while the run is still going).

    The trainer writes non-finite floats as strings ("nan", "inf"); they come back as floats.
    """
    summary = _read_json(Path(arm_dir) / "summary.json")
    if summary is None:
        return None
    for k in _NUMERIC_SUMMARY_FIELDS:
        if isinstance(summary.get(k), str):
            try:
                summary[k] = float(summary[k])
            except ValueError:
                summary[k] = math.nan
    return summary


# ---- tags -------------------------------------------------------------------------------------


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"(\{i\}|\{h\})", template)
    body = "".join(
        "(?P<i>\\d+)" if p == "{i}" else "(?P<h>\\d+)" if p == "{h}" else re.escape(p)
        for p in parts
    )
    return re.compile(f"^{body}$")


def layer_tags(tag_names, template: str = tags.MAX_LOGIT_LAYER) -> dict[int, str]:
    """``{layer index: tag}`` for the tags in ``tag_names`` that match a per-layer template."""
    rx = _template_regex(template)
    out = {}
    for t in tag_names:
        m = rx.match(t)
        if m:
            out[int(m.group("i"))] = t
    return dict(sorted(out.items()))


def series(df: pd.DataFrame, tag: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps_N, values_N)`` of one tag in a one-arm frame, sorted by step (empty if absent)."""
    if df[["run", "arm"]].drop_duplicates().shape[0] > 1:
        raise ValueError("series() needs the rows of one run arm; filter by run and arm first")
    sel = df[df["tag"] == tag].sort_values("step", kind="stable")
    return sel["step"].to_numpy(np.int64), sel["value"].to_numpy(np.float64)


def arms(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The (run, arm) pairs of a tidy frame, in order."""
    return [tuple(x) for x in df[["run", "arm"]].drop_duplicates().itertuples(index=False)]


def select(df: pd.DataFrame, run: str, arm: str) -> pd.DataFrame:
    return df[(df["run"] == run) & (df["arm"] == arm)]
