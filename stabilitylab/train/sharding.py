"""FSDP2 through accelerate: what the trainer accepts, and how it saves and loads sharded state.

    accelerate launch --config_file experiments/launch/fsdp.yaml --num_processes 2 \\
        experiments/stress_8k.py --telemetry.probe_every=0

accelerate reads the launch config's ``fsdp_config`` into a ``FullyShardedDataParallelPlugin``
and ``Accelerator.prepare`` shards the model with ``fully_shard``: each ``Block`` (the lab's
transformer block) a unit, then the final norm, then the root (embeddings, head). What the
trainer adds:

- :func:`check`: the settings it runs, refused otherwise before any work (one ``error:`` line):
  FSDP2 (``fsdp_version: 2``), ``TRANSFORMER_BASED_WRAP`` on ``Block``, ``SHARDED_STATE_DICT``;
  no parameter offload or activation checkpointing (never run here); no live Jacobian probe
  (``telemetry.probe_every``), which runs the layers on the main process alone; the stress
  study's encoder only (the KV study's decoder validates on shares of unequal size).
- :func:`plugin`: the plugin with mixed precision left to autocast. accelerate's own FSDP2 mixed
  precision casts the parameters to bf16 and reduces the gradients in bf16; the lab's runs on one
  GPU and under DDP keep float32 weights and gradients and run the forward under bf16 autocast.
  So the policy casts nothing and :func:`autocast_forward` wraps the forward in accelerate's
  autocast, as accelerate does for a model it does not shard.
- :func:`enable_on_cpu`: accelerate (1.15) turns FSDP on only for GPU-type setups; over gloo on
  CPU its state stays ``MULTI_CPU`` and ``prepare`` wraps the model in DDP without a word. The
  trainer sets the state to FSDP with the plugin, so that accelerate's own FSDP2 preparation
  runs over gloo as it does over NCCL (the CPU tests run it so).
- checkpoints through ``torch.distributed.checkpoint`` (DCP): :func:`save` writes the model's
  and the optimizer's sharded state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``,
  keyed by parameter name) into ``model/`` and ``optimizer/``, every rank its own file
  ``__<rank>_0.distcp`` and rank 0 the ``.metadata``; :func:`load` reads them back on any number
  of processes (DCP reshards); :func:`read_model` reads the full weights in one process without
  a process group (the report's and the KV study's readers, ``train.init_from``).

Elsewhere: each micro-batch's gradient is reduce-scattered at once (``build.Trainee.no_sync``);
the fast step compiles with graph breaks at each unit's hooks (``fast.FSDP_NOTE``); the gradient
and layer norms are gathered from the shards (``telemetry``). Ran on two CPU processes over gloo,
in float32 and under bf16 autocast (tests/test_multi_gpu_configs.py); not yet over NCCL.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import torch

from stabilitylab.config import Config, ConfigError

WRAP_CLASS = "Block"
"""The module class each FSDP unit is (``stabilitylab.model.Block``)."""
DIRS = ("model", "optimizer")
"""The DCP folders of a sharded checkpoint."""
METADATA = ".metadata"


def requested() -> bool:
    """Whether the launcher asked for FSDP (``accelerate launch`` with an ``fsdp_config``, or
    ``--use_fsdp``, sets ACCELERATE_USE_FSDP)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1", "yes")


def _refuse(key: str, msg: str) -> ConfigError:
    """A launch-config key the trainer does not run, named as the YAML's ``fsdp_config`` names it."""
    return ConfigError(
        f"config fsdp_config.{key}: {msg} (experiments/launch/fsdp.yaml has the settings)"
    )


def plugin():
    """accelerate's FSDP plugin from the launch environment, FSDP2's mixed precision a no-op
    (module docstring); a value accelerate refuses becomes a ``ConfigError``."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    try:
        p = FullyShardedDataParallelPlugin()
    except (ValueError, KeyError, ImportError) as e:
        raise ConfigError(f"config fsdp_config: accelerate refuses it: {e}") from None
    if p.fsdp_version == 2:
        p.mixed_precision_policy = MixedPrecisionPolicy()  # kept: accelerate sets only a None one
    return p


def check(cfg: Config) -> None:
    """Refuse an FSDP launch the trainer does not run (module docstring); nothing when FSDP was
    not asked for."""
    if not requested():
        return
    from accelerate import PartialState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import CPUOffloadPolicy

    p = plugin()
    if p.fsdp_version != 2:
        raise _refuse("fsdp_version", f"{p.fsdp_version}; the trainer shards with FSDP2: set 2")
    policy = getattr(p.auto_wrap_policy, "__name__", None)
    names = p.transformer_cls_names_to_wrap
    if policy != "transformer_auto_wrap_policy" or names != [WRAP_CLASS]:
        got = os.environ.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
        raise _refuse(
            "fsdp_auto_wrap_policy",
            f"{got} on {names}; each {WRAP_CLASS} of the model is one unit: set "
            f"TRANSFORMER_BASED_WRAP and fsdp_transformer_layer_cls_to_wrap: {WRAP_CLASS}",
        )
    if p.state_dict_type.name != "SHARDED_STATE_DICT":
        raise _refuse(
            "fsdp_state_dict_type",
            f"{p.state_dict_type.name}; the trainer's FSDP checkpoints are sharded "
            "(torch.distributed.checkpoint): set SHARDED_STATE_DICT",
        )
    for key, on in (
        ("fsdp_offload_params", isinstance(p.cpu_offload, CPUOffloadPolicy)),
        ("fsdp_activation_checkpointing", p.activation_checkpointing),
    ):
        if on:
            raise _refuse(key, "true has never run in this trainer: set false")
    if cfg.task == "lm":
        raise ConfigError(
            "config task: the KV study's decoder has not run under FSDP (its validation passes "
            "run each process's own share of the windows, which FSDP's collectives cannot "
            "when the shares differ): launch it without FSDP"
        )
    if cfg.telemetry.probe_every:
        raise ConfigError(
            f"config telemetry.probe_every: {cfg.telemetry.probe_every}; the live Jacobian probe "
            "runs the layers on the main process alone, which FSDP's sharded layers cannot: "
            "pass --telemetry.probe_every=0"
        )
    if PartialState().distributed_type == DistributedType.NO:
        raise ConfigError(
            "config fsdp_config: FSDP was asked (ACCELERATE_USE_FSDP) in a process that no "
            "launcher started: run accelerate launch --config_file experiments/launch/fsdp.yaml"
        )


def enable_on_cpu(accelerator, fsdp_plugin) -> None:
    """Put accelerate's state into FSDP on a CPU host (module docstring): the gloo processes
    accelerate launch started (``MULTI_CPU``). Called before ``prepare``; the state is shared, so
    the arms after the first find it set."""
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = fsdp_plugin
    elif state.distributed_type != DistributedType.FSDP:
        raise ConfigError(
            f"config fsdp_config: accelerate set up {state.distributed_type.value}, not FSDP: "
            "run accelerate launch --config_file experiments/launch/fsdp.yaml"
        )


def autocast_forward(model: torch.nn.Module, accelerator) -> None:
    """The model's forward under accelerate's autocast (and its outputs in float32), as
    ``Accelerator.prepare`` makes it for a model it does not shard; nothing without mixed
    precision."""
    from accelerate.utils import convert_outputs_to_fp32

    if accelerator.mixed_precision == "no":
        return
    forward = model.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with accelerator.autocast():
            return forward(*args, **kwargs)

    model.forward = convert_outputs_to_fp32(run)


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def files(world: int) -> list[str]:
    """The files a sharded checkpoint's DCP folders hold when ``world`` processes wrote it."""
    return [f"{d}/{name}" for d in DIRS for name in [METADATA, *shard_files(world)]]


def shard_files(world: int) -> list[str]:
    """DCP's file per rank (``FileSystemWriter``, one file per rank and one thread)."""
    return [f"__{rank}_0.distcp" for rank in range(world)]


def _inner(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # under accelerate's wrapper


def save(path: Path, model: torch.nn.Module, optimizer) -> None:
    """Every rank writes its shards of the model and the optimizer into ``path/model`` and
    ``path/optimizer``; a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    dcp.save(get_model_state_dict(model), checkpoint_id=path / "model")
    dcp.save(get_optimizer_state_dict(model, _inner(optimizer)), checkpoint_id=path / "optimizer")


def load(path: Path, model: torch.nn.Module, optimizer) -> None:
    """Model and optimizer from ``path/model`` and ``path/optimizer``, resharded to this run's
    processes; a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    inner = _inner(optimizer)
    model_sd = get_model_state_dict(model)
    dcp.load(model_sd, checkpoint_id=path / "model")
    set_model_state_dict(model, model_sd)
    optim_sd = get_optimizer_state_dict(model, inner)
    dcp.load(optim_sd, checkpoint_id=path / "optimizer")
    set_optimizer_state_dict(model, inner, optim_sd)


def read_model(path: Path) -> dict[str, torch.Tensor]:
    """The full weights of sharded checkpoint ``path`` in this process alone (no process group):
    empty tensors shaped from DCP's metadata, filled by ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(path / "model")
    meta = reader.read_metadata().state_dict_metadata
    weights = {
        name: torch.empty(m.size, dtype=m.properties.dtype)
        for name, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(weights, storage_reader=reader, no_dist=True)
    return weights
