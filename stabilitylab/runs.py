"""Run directories: layout, resolved config, vocabulary, provenance and the final summary.

<out_dir>/<name>/<arm>/          an arm of the stress study or a cell of the KV-eviction study
    config.json        resolved config the arm started with (+ arm, backend, mixed_precision;
                       for a cell, model.gates and model.position are the cell's; data holds
                       what the data turned out to be: n_genes, the source's real vocabulary,
                       e.g. an .h5ad file's genes; for text vocab_size, train_tokens and the
                       train split's sha256)
    vocab.json         cells: token id -> gene name, token ``t >= gene_token_offset`` is gene
                       ``genes[t - gene_token_offset]``, the ids below are the special tokens;
                       text: the tokenizer, and with a compact vocabulary model id -> GPT-2 id
    provenance.json    git commit / dirty flag, torch / triton / CUDA / GPU, host, command of the
                       first start; "resumes" lists every later start (step, command, and any
                       config change forced with --resume=force); at the end of each segment
                       the Triton autotune choices made so far in the process
    events.out.tfevents.*   TensorBoard scalars (written live)
    checkpoints/       last/ and, on divergence, forensic_step<N>/ (stabilitylab.train.checkpoint)
    summary.json       written at the end of every run segment, also a diverged or interrupted one
<out_dir>/<name>/<arm>.lock   held while a process runs the arm (``stabilitylab.runlock``)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from stabilitylab import runlock
from stabilitylab.config import Config, to_dict
from stabilitylab.telemetry import perplexity


def arm_dir(cfg: Config, arm: str) -> Path:
    return Path(cfg.out_dir) / cfg.name / arm


def study_dir(cfg: Config) -> Path:
    """Where the KV study writes its tables: ``study.out_dir``, default ``<out_dir>/<name>/study``."""
    return Path(cfg.study.out_dir or Path(cfg.out_dir) / cfg.name / "study")


@contextlib.contextmanager
def hold(dirs: Iterable[Path]) -> Iterator[None]:
    """Hold the locks of ``dirs`` (``runlock.hold``) for the block: on the main process, which
    alone writes the shared files; its verdict is broadcast, so that with another process on the
    run every process of this one raises ``RunBusy`` before any work."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list

    state = PartialState(cpu=not torch.cuda.is_available())
    with contextlib.ExitStack() as stack:
        busy = [None]
        if state.is_main_process:
            try:
                stack.enter_context(runlock.hold(dirs))
            except runlock.RunBusy as e:
                busy[0] = str(e)
        if state.num_processes > 1:
            busy = broadcast_object_list(busy)
        if busy[0] is not None:
            raise runlock.RunBusy(busy[0])
        yield


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


def resolved_config(cfg: Config, arm: str, backend: str, precision: str, data_facts: dict) -> dict:
    """The config an arm runs with (``cfg`` is the arm's own, ``Config.arm_config``), as
    config.json records it; ``data_facts`` join the data section (``TaskData.facts``)."""
    d = {**to_dict(cfg), "arm": arm, "backend": backend, "mixed_precision": precision}
    d["data"] = {**d["data"], **data_facts}
    return d


def start_arm(d: Path, config: dict, vocab: dict) -> Path:
    """A fresh arm dir: whatever an earlier run left there is deleted first."""
    if d.exists():
        shutil.rmtree(d)
    (d / "checkpoints").mkdir(parents=True)
    write_json(d / "config.json", config)
    write_json(d / "provenance.json", provenance())
    write_json(d / "vocab.json", vocab)
    return d


def record_resume(d: Path, step: int, changes: dict) -> None:
    """A later start of the arm joins provenance.json's "resumes" (the first start stays)."""
    path = d / "provenance.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    now = provenance()
    entry = {k: now[k] for k in ("command", "started", "host", "git_commit", "world_size")}
    entry["step"] = step
    if changes:
        entry["config_changes"] = changes
    write_json(path, {**info, "resumes": [*info.get("resumes", []), entry]})


def add_provenance(d: Path, **fields) -> None:
    """Facts known only at the end of an arm (e.g. the autotune choices) join provenance.json."""
    path = d / "provenance.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    write_json(path, {**info, **fields})


def read_summary(d: Path) -> dict | None:
    """summary.json of an arm dir; None when it is missing or unreadable (a run cut before it)."""
    path = d / "summary.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return None


def write_summary(d: Path, **fields) -> dict:
    summary = {k: (_finite_or_str(v) if isinstance(v, float) else v) for k, v in fields.items()}
    write_json(d / "summary.json", summary)
    return summary


def arm_summary(
    *,
    arm: str,
    backend: str,
    status: str,
    divergence,
    hist,
    steps: int,
    interrupted: bool,
    params: int,
    init_hash: str,
    peak_lr: float,
    log_logits: bool,
    peak_mem_gib: float | None,
) -> dict:
    """The summary.json fields of an arm: outcome, extremes, first and last loss, cost.
    ``divergence`` and ``hist`` are the trainer's (``stabilitylab.train.policy``) records."""
    div = divergence
    finite_gn = [g for g in hist.grad_norm if math.isfinite(g)]
    finite_loss = [x for x in hist.loss if math.isfinite(x)]
    return {
        "arm": arm,
        "backend": backend,
        "status": status,
        "divergence_step": None if div is None else div.step,
        "divergence_reason": None if div is None else div.reason,
        "first_nonfinite_module": None if div is None else div.module,
        "nonfinite_steps": len(hist.nonfinite_steps),
        "max_grad_norm": max(finite_gn) if finite_gn else None,
        "max_logit": hist.max_logit if log_logits else None,
        "steps": steps,
        "wall_time_s": hist.wall_time_s,
        "peak_mem_gib": peak_mem_gib,
        "initial_loss": hist.loss[0] if hist.loss else None,
        "final_loss": finite_loss[-1] if finite_loss else None,
        "params": params,
        "init_hash": init_hash,
        "peak_lr": peak_lr,
        "interrupted_by_signal": interrupted,
        **lm_summary(hist),
    }


def lm_summary(hist) -> dict:
    """The next-token task's summary fields, from what the history holds (none for cells):
    validation loss and perplexity at the first and last pass, the last logged CE, and the
    last logged gate mean and binarization (fraction of gates < 0.05 or > 0.95, all layers)."""
    out = {}
    if hist.val_loss:
        out["first_val_ppl"] = perplexity(hist.val_loss[0])
        out["final_val_loss"] = hist.val_loss[-1]
        out["final_val_ppl"] = perplexity(hist.val_loss[-1])
    names = {"ce_loss": "final_ce_loss", "gate_mean": "gate_mean", "gate_frac_binary": "gate_frac_binary"}  # fmt: skip
    out.update({names[k]: v for k, v in hist.last.items() if k in names})
    return out


def dead_gates(gate_mean_L: list[float], below: float) -> dict:
    """A gated arm's summary fields: ``gate_mean_layers`` (each gate layer's mean gate at the last
    logged step), ``dead_gate_layers`` (the layers, numbered as gate/mean/layer_{i}, whose mean
    is below ``below``; None when no step was logged) and ``dead_gate_below``. A NaN mean is not
    below anything: it is no dead gate but a broken one, and stays visible in the means."""
    if not gate_mean_L:
        return {"gate_mean_layers": None, "dead_gate_layers": None, "dead_gate_below": below}
    dead = [i for i, m in enumerate(gate_mean_L) if m < below]
    return {
        "gate_mean_layers": [_finite_or_str(m) for m in gate_mean_L],
        "dead_gate_layers": dead,
        "dead_gate_below": below,
    }


SUMMARY_COLUMNS = (
    "status",
    "divergence_step",
    "steps",
    "initial_loss",
    "final_loss",
    "max_grad_norm",
    "max_logit",
    "wall_time_s",
)


LM_COLUMNS = ("final_ce_loss", "first_val_ppl", "final_val_ppl", "gate_mean", "gate_frac_binary")
"""Columns the table adds when an arm has them (the next-token task)."""


def print_summaries(summaries: dict[str, dict]) -> None:
    extra = [c for c in LM_COLUMNS if any(c in s for s in summaries.values())]
    columns = [*SUMMARY_COLUMNS, *extra]
    width = max([8, *(len(a) for a in summaries)])
    print(f"\n{'arm':<{width}} " + " ".join(f"{c:>15}" for c in columns))
    for arm, s in summaries.items():
        cells = []
        for c in columns:
            v = s.get(c)
            cells.append(f"{v:>15.4g}" if isinstance(v, float) else f"{v!s:>15}")
        print(f"{arm:<{width}} " + " ".join(cells))
