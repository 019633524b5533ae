"""Checkpoints as one atomic unit: weights, optimizer, every process's RNG state, step, history.

    <arm dir>/checkpoints/last/              the resume point
        state.pt                             model, optimizer, step, history (main process)
        rng0.pt ... rng<W-1>.pt              torch CPU + CUDA RNG state of process 0 .. W-1
        manifest.json                        step, world size, config, extra, and every file
                                             above with its size and sha256; written last
    <arm dir>/checkpoints/forensic_step<N>/  the same; manifest "extra" holds the divergence

Under FSDP (``stabilitylab.train.sharding``) the weights and the optimizer are sharded, and a
checkpoint holds them as torch.distributed.checkpoint (DCP) writes them (manifest ``"layout":
"sharded"``; ``"full"``, or no key in a manifest written before the key existed, is the layout
above)::

        state.pt                             step, history (main process)
        rng0.pt ... rng<W-1>.pt              as above
        model/__0_0.distcp ... __<W-1>_0.distcp, model/.metadata          every rank's shard
        optimizer/__0_0.distcp ... __<W-1>_0.distcp, optimizer/.metadata  of each, DCP's index
        manifest.json                        as above, every file listed

A run resumes only a checkpoint of its own layout (a sharded one under FSDP, a full one
otherwise), with any number of processes (DCP reshards; the dropout draws resume only at the same
number). ``read_state`` gives the full weights of either layout in one process.

Writing: every process writes its files into ``<name>.tmp/``; after a barrier the main process
hashes them, writes the manifest and commits with one rename of ``<name>.tmp`` to ``<name>``. A
previous ``<name>`` is first renamed to ``<name>.prev`` (a folder cannot be renamed over a
non-empty one) and deleted after the commit. So a kill at any moment leaves either the old
checkpoint or the new one complete: ``last``, or ``last.prev`` alone when the kill fell between
the two renames; :func:`find_last` takes whichever exists and the next save renames ``last.prev``
back first. A committed checkpoint is verified against its manifest when loaded: a missing or
corrupt file stops the resume with an error naming the file (there is no older complete
checkpoint to fall back to; ``--fresh=True`` starts over). Files load with
``torch.load(weights_only=True)``. Processes on several hosts need a shared filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from stabilitylab.train import sharding

FORMAT = 1
LAST = "last"
STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
FULL, SHARDED = "full", "sharded"
"""Manifest ``layout``: weights and optimizer in ``state.pt``, or sharded in DCP folders."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file."""


def rng_file(rank: int) -> str:
    return f"rng{rank}.pt"


def rng_state() -> dict:
    """This process's torch RNG state: CPU, and its current CUDA device when there is one."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
        os.fsync(f.fileno())  # durable before the commit rename makes it the checkpoint
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    ckpt_dir: Path,
    name: str,
    accelerator,
    model,
    optimizer,
    *,
    step: int,
    history: dict,
    config: dict,
    extra: dict | None = None,
) -> Path:
    """Write checkpoint ``ckpt_dir/name`` atomically; every process calls this."""
    final, tmp = ckpt_dir / name, ckpt_dir / f"{name}.tmp"
    main, world = accelerator.is_main_process, accelerator.num_processes
    if main:
        recover(ckpt_dir, name)
        if tmp.exists():  # left by a kill during an earlier save
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    torch.save(rng_state(), tmp / rng_file(accelerator.process_index))
    layout = SHARDED if sharding.is_sharded(model) else FULL
    state = {"step": step, "history": history}
    if layout == SHARDED:
        sharding.save(tmp, model, optimizer)
    elif main:
        state = {
            "model": accelerator.unwrap_model(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            **state,
        }
    if main:
        torch.save(state, tmp / STATE_FILE)
    accelerator.wait_for_everyone()
    if main:
        files = [STATE_FILE] + [rng_file(r) for r in range(world)]
        files += sharding.files(world) if layout == SHARDED else []
        _write_manifest(tmp, files, step, world, config, extra or {}, layout)
        _commit(tmp, final)
    accelerator.wait_for_everyone()
    return final


def _write_manifest(
    tmp: Path, files: list[str], step: int, world: int, config, extra, layout: str
) -> None:
    missing = [f for f in files if not (tmp / f).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {tmp}: no {', '.join(missing)} was written")
    manifest = {
        "format": FORMAT,
        "layout": layout,
        "step": step,
        "world_size": world,
        "files": {
            f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in files
        },
        "config": config,
        "extra": extra,
    }
    with open(tmp / MANIFEST_FILE, "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())


def _commit(tmp: Path, final: Path) -> None:
    prev = final.with_name(final.name + ".prev")
    if prev.exists():  # a kill while deleting it after the last commit; ``final`` is complete
        shutil.rmtree(prev)
    if final.exists():
        os.rename(final, prev)
    os.rename(tmp, final)  # the commit
    _fsync_dir(final.parent)
    shutil.rmtree(prev, ignore_errors=True)


def recover(ckpt_dir: Path, name: str = LAST) -> None:
    """A kill between the two renames of a commit leaves only ``<name>.prev``: make it ``name``."""
    final = ckpt_dir / name
    prev = final.with_name(name + ".prev")
    if not final.exists() and prev.exists():
        os.rename(prev, final)


def find_last(ckpt_dir: Path) -> Path | None:
    """The resume point: ``last`` (or ``last.prev``, see the module docstring); None if neither."""
    if (ckpt_dir / "last.pt").exists() and not (ckpt_dir / LAST).exists():
        raise CheckpointError(
            f"{ckpt_dir / 'last.pt'} is a checkpoint of an older layout, which this trainer "
            "does not resume; move the run dir away or pass --fresh=True"
        )
    for name in (LAST, LAST + ".prev"):
        if (ckpt_dir / name).is_dir():
            return ckpt_dir / name
    return None


def _read_manifest(path: Path) -> dict:
    manifest_path = path / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
        manifest["files"].items()
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path} is missing or unreadable ({e}); "
            "pass --fresh=True to start over"
        ) from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path}: format {manifest.get('format')!r}, "
            f"this trainer reads format {FORMAT}"
        )
    return manifest


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint ``path`` (step, world size, the resolved config), files not
    checked: what a check before any work reads (``verify`` hashes every file)."""
    return _read_manifest(path)


def verify(path: Path) -> dict:
    """The manifest of checkpoint ``path``, after checking every file it lists."""
    manifest = _read_manifest(path)
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing (listed in {MANIFEST_FILE})")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint file {f} is corrupt: its size or sha256 differs from {MANIFEST_FILE}"
            )
    return manifest


def _load(path: Path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same to the user
        raise CheckpointError(f"checkpoint file {path} cannot be loaded: {e}") from e


def layout_of(manifest: dict) -> str:
    return manifest.get("layout", FULL)


def check_layout(path: Path, manifest: dict, sharded: bool) -> None:
    """A run under FSDP resumes a sharded checkpoint only, any other run a full one only."""
    layout, want = layout_of(manifest), SHARDED if sharded else FULL
    if layout != want:
        how = (
            "launch with the FSDP config that wrote it (experiments/launch/fsdp.yaml)"
            if layout == SHARDED
            else "launch without FSDP, as it was written"
        )
        raise CheckpointError(
            f"checkpoint {path} holds {layout} weights and this run is "
            f"{'under FSDP' if sharded else 'not under FSDP'}: {how}, or pass --fresh=True"
        )


def read_state(path: Path) -> dict:
    """``state.pt`` of a verified checkpoint: model, optimizer, step, history; of a sharded one
    step, history and the full model (``sharding.read_model``), no optimizer."""
    manifest = verify(path)
    state = _load(path / STATE_FILE)
    if layout_of(manifest) == SHARDED:
        try:
            state["model"] = sharding.read_model(path)
        except Exception as e:  # noqa: BLE001 - any DCP read failure means the same to the user
            raise CheckpointError(f"checkpoint {path / 'model'} cannot be loaded: {e}") from e
    return state


def load(path: Path, accelerator, model, optimizer, verified: bool = False) -> tuple[int, dict]:
    """Restore model, optimizer and this process's RNG state; returns (step, history).
    ``verified``: the main process has checked the files against the manifest already."""
    manifest = _read_manifest(path) if verified else verify(path)
    state = _load(path / STATE_FILE)
    if layout_of(manifest) == SHARDED:
        sharding.load(path, model, optimizer)
    else:
        accelerator.unwrap_model(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    if manifest["world_size"] == accelerator.num_processes:
        set_rng_state(_load(path / rng_file(accelerator.process_index)))
    elif accelerator.is_main_process:
        accelerator.print(
            f"warning: {path} was written by {manifest['world_size']} processes, this run has "
            f"{accelerator.num_processes}: weights and data order resume, dropout draws do not"
        )
    return state["step"], state["history"]
