"""Run directories: layout, resolved config, provenance and the final summary.

<out_dir>/<name>/<arm>/
    config.json        resolved config (+ arm and backend)
    provenance.json    git commit / dirty flag, torch / triton / CUDA / GPU, host, command, and
                       at the end the Triton autotune choices made so far in the process
    events.out.tfevents.*   TensorBoard scalars (written live)
    checkpoints/       last.pt, forensic_step<N>.pt on divergence
    summary.json       written at the end of every run, also a diverged or interrupted one
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from stabilitylab.config import Config, to_dict


def arm_dir(cfg: Config, arm: str) -> Path:
    return Path(cfg.out_dir) / cfg.name / arm


def _git(args: list[str]) -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency
        triton_version = None
    status = _git(["status", "--porcelain", "--untracked-files=no"])
    info = {
        "git_commit": _git(["rev-parse", "HEAD"]),
        "git_dirty": None if status is None else bool(status),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": torch.cuda.device_count(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "command": " ".join(sys.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
    }
    return info


def write_json(path: Path, obj: dict) -> None:
    """Atomic write: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_jsonable))
    os.replace(tmp, path)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")


def _finite_or_str(x: float | None):
    if x is None:
        return None
    return x if math.isfinite(x) else str(x)


def start_arm(cfg: Config, arm: str, backend: str) -> Path:
    d = arm_dir(cfg, arm)
    (d / "checkpoints").mkdir(parents=True, exist_ok=True)
    write_json(d / "config.json", {**to_dict(cfg), "arm": arm, "backend": backend})
    write_json(d / "provenance.json", provenance())
    return d


def add_provenance(d: Path, **fields) -> None:
    """Facts known only at the end of an arm (e.g. the autotune choices) join provenance.json."""
    path = d / "provenance.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    write_json(path, {**info, **fields})


def write_summary(d: Path, **fields) -> dict:
    summary = {k: (_finite_or_str(v) if isinstance(v, float) else v) for k, v in fields.items()}
    write_json(d / "summary.json", summary)
    return summary
