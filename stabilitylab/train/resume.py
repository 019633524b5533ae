"""How an arm starts: fresh, resumed from its checkpoint, or already finished.

- ``--fresh=True``: start over; the arm dir is deleted first, so no event file, summary or
  checkpoint of an earlier run survives to mix into the report.
- a checkpoint exists (default ``--resume=auto``): resume from it when the config agrees with
  the checkpoint's in every key that changes training; otherwise stop with an error naming the
  keys (``train.lr: 0.001 -> 0.01``). ``--resume=force`` resumes anyway and the change is
  recorded in provenance.json ("resumes"); config.json keeps the values the run started with.
- summary.json says the arm finished (its steps reached ``train.steps``, or it diverged under
  ``on_divergence=stop``): nothing runs and nothing in the arm dir is rewritten.
- no checkpoint: a fresh start, which also clears what a run killed before its first checkpoint
  left behind; but a run that ended (summary.json) and lost its checkpoint is refused, not
  deleted.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from stabilitylab.config import Config
from stabilitylab.train import checkpoint

# Keys a resumed arm may change: they do not change what it trains (the arm's own backend is
# compared as the resolved ``backend`` key, a cell's settings as its model keys; ``cells`` only
# picks which cells run; ``train.steps`` is how a run is extended; ``train.fast`` computes the
# same step, rounded differently, so a run started before it existed, or with it off, resumes
# under the presets' default, and the other way round; ``train.group_by_length`` groups the same
# sequences of a step into other micro-batches; ``data.pad_to_multiple`` adds masked padding only;
# ``train.init_from`` is read at a fresh start only: a resumed arm loads its own checkpoint).
FREE_KEYS = (
    "preset",
    "cells",
    "out_dir",
    "resume",
    "fresh",
    "report",
    "allow_cpu",
    "trackers",
    "num_workers",
    "sigmoid_backend",
    "softmax_backend",
    "train.steps",
    "train.checkpoint_every",
    "train.peak_tflops",
    "train.fast",
    "train.group_by_length",
    "data.pad_to_multiple",
    "train.init_from",
)
FREE_PREFIXES = ("telemetry.", "study.")  # what is logged; how the trained cells are evaluated


class ResumeError(ValueError):
    """The run on disk cannot be resumed with this config; the message names the keys."""


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = list(v) if isinstance(v, tuple) else v
    return out


def with_defaults(flat: dict) -> dict:
    """A flattened config with every ``Config`` key it lacks at its dataclass default: a config
    saved before a key existed meant that default (the keys are added with the old behaviour as
    their default), so a resume compares it as such, not as ``<absent>``."""
    defaults = flatten(dataclasses.asdict(Config()))
    return {**{k: v for k, v in defaults.items() if k not in flat}, **flat}


def config_changes(saved: dict, current: dict) -> dict[str, list]:
    """``{key: [saved value, current value]}`` for every training key that differs; a key that
    one side lacks counts at its default (``with_defaults``)."""
    old, new = with_defaults(flatten(saved)), with_defaults(flatten(current))
    changes = {}
    for key in sorted(old.keys() | new.keys()):
        if key in FREE_KEYS or key.startswith(FREE_PREFIXES):
            continue
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            changes[key] = [old.get(key, "<absent>"), new.get(key, "<absent>")]
    return changes


def describe(changes: dict[str, list]) -> str:
    return ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changes.items())


def finished(summary: dict | None, steps: int, on_divergence: str) -> bool:
    if not summary:
        return False
    if summary.get("status") == "diverged" and on_divergence == "stop":
        return True
    return summary.get("status") != "interrupted" and summary.get("steps", 0) >= steps


@dataclass
class Start:
    kind: Literal["fresh", "resume", "done"]
    checkpoint: Path | None = None
    step: int = 0
    changes: dict[str, list] = field(default_factory=dict)
    summary: dict | None = None


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError as e:
        raise ResumeError(
            f"{path} is not valid JSON ({e}); pass --fresh=True to start over"
        ) from None


def plan(cfg, arm_dir: Path, resolved: dict, sharded: bool = False) -> Start:
    """What this arm does given its dir and ``resolved`` (the config it would run with);
    ``sharded``: the run is under FSDP, so its checkpoint must be sharded
    (``checkpoint.check_layout``)."""
    if cfg.fresh:
        return Start("fresh")
    last = checkpoint.find_last(arm_dir / "checkpoints")
    summary = _read_json(arm_dir / "summary.json")
    done = finished(summary, cfg.train.steps, cfg.train.on_divergence)
    if last is None and not done:
        if summary is not None:  # an ended run whose checkpoint is gone: never delete it unasked
            raise ResumeError(
                f"{arm_dir} holds a run that ended at step {summary.get('steps')} and no "
                "checkpoint to continue it from; --fresh=True starts over"
            )
        return Start("fresh")
    manifest = checkpoint.verify(last) if last is not None else None
    if manifest is not None:
        checkpoint.check_layout(last, manifest, sharded)
    saved = manifest["config"] if manifest else _read_json(arm_dir / "config.json")
    changes = config_changes(saved or {}, resolved)
    if changes and cfg.resume != "force":
        raise ResumeError(
            f"{arm_dir} holds a run with another config: {describe(changes)}. "
            "--resume=force continues it with the new values, --fresh=True starts over"
        )
    if done:
        return Start("done", summary=summary, changes=changes)
    return Start("resume", last, manifest["step"], changes)
