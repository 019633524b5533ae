"""Start an arm from trained weights: ``train.init_from`` and the KV study's -ft cells.

    warmstart.check_sources(cfg)                  # before any work: each source and its shape
    warmstart.check_vocab(cfg, data.vocab_size)   # once the data is open, before any training
    info = warmstart.load_init(model, cfg, arm)   # at an arm's fresh start (cfg: the arm's own)

A source is a trained arm / cell directory (its ``checkpoints/last``) or a checkpoint directory
itself (with ``manifest.json``, whose ``config`` is the resolved config of the run that wrote it:
the checks read it and no weight). It must be a dense model (no gates) of the arm's shape
(``SHAPE_KEYS``), attention kind and vocabulary. The arm's model takes every weight of the
source; its gates, which a dense source lacks, keep their initialisation (w = 0, b =
model.gate_bias_init: g = sigmoid(5) = 0.9933, so the model starts as the dense one up to that
factor on each key's logit and value). The optimizer and the schedule start fresh.

An -ft cell's source is its backbone in the same run (``Config.arm_config`` sets ``init_from`` to
``<out_dir>/<name>/<backbone>``): listed earlier in --cells (``Config`` checks the order and the
trainer trains in order), or trained to its end on disk. Each refusal is a ``ConfigError`` naming
the key (``train.init_from``, or ``cells`` for an -ft cell); only an arm that starts fresh is
checked (a resumed or finished arm never reads its source again).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import torch

from stabilitylab import runs
from stabilitylab.config import (
    ALL_CELLS,
    ARMS,
    N_SPECIAL_TOKENS,
    Config,
    ConfigError,
    backbone_of,
    cell_settings,
    is_finetune,
)
from stabilitylab.model import TokenGate
from stabilitylab.train import checkpoint
from stabilitylab.train.resume import finished, flatten, with_defaults

SHAPE_KEYS = (
    "model.n_layers", "model.d_model", "model.n_heads", "model.d_ff", "model.causal",
    "model.position", "model.qk_norm", "model.qk_layernorm", "data.context_len", "data.vocab",
)  # fmt: skip
"""What a source shares with the arm that starts from it (the attention kind, the gates and the
vocabulary size are checked beside them)."""


def refuse(arm: str, source: Path, problem: str) -> ConfigError:
    """One error line naming the key: ``cells`` for an -ft cell, else ``train.init_from``."""
    if is_finetune(arm):
        return ConfigError(
            f"config cells: {arm} starts from its backbone {backbone_of(arm)}, and {source} "
            f"{problem}"
        )
    return ConfigError(f"config train.init_from: {source} (where {arm} starts) {problem}")


def source_checkpoint(source: Path, arm: str) -> Path:
    """The checkpoint of a source: the source itself when it holds manifest.json, else its
    ``checkpoints/last``."""
    if (source / checkpoint.MANIFEST_FILE).is_file():
        return source
    if not source.is_dir():
        b = backbone_of(arm)
        hint = (
            f" ({b} is neither earlier in --cells nor trained): list {b} before {arm}"
            if is_finetune(arm)
            else ""
        )
        raise refuse(arm, source, f"does not exist{hint}")
    try:
        last = checkpoint.find_last(source / "checkpoints")
    except checkpoint.CheckpointError as e:
        raise refuse(arm, source, f"holds no usable checkpoint ({e})") from None
    if last is None:
        raise refuse(
            arm, source, "holds no checkpoint (no checkpoints/last, and no manifest.json itself)"
        )
    return last


def source_config(ckpt: Path, source: Path, arm: str) -> dict:
    """The resolved config the source's run saved in its checkpoint's manifest."""
    try:
        manifest = checkpoint.read_manifest(ckpt)
    except checkpoint.CheckpointError as e:
        raise refuse(arm, source, f"holds no usable checkpoint ({e})") from None
    return manifest["config"]


def attention_kind(resolved: dict) -> str | None:
    """softmax / sigmoid of a saved arm or cell (None when its config names neither)."""
    arm = resolved.get("arm")
    if arm in ARMS:
        return arm
    return cell_settings(arm)[0] if arm in ALL_CELLS else None


def check_shape(resolved: dict, cfg: Config, arm: str, source: Path) -> None:
    """The source is dense and has the arm's shape (``SHAPE_KEYS``) and attention kind."""
    have = with_defaults(flatten(resolved))
    if have.get("model.gates"):
        raise refuse(arm, source, "is a gated model (model.gates=True); start from a dense one")
    want = flatten(dataclasses.asdict(cfg))
    diffs = [
        f"{k}={have.get(k)!r} there, {want[k]!r} here" for k in SHAPE_KEYS if have.get(k) != want[k]
    ]
    kind = attention_kind(resolved)
    if kind != cfg.attention_of(arm):
        diffs.append(f"attention {kind} there, {cfg.attention_of(arm)} here")
    if diffs:
        raise refuse(arm, source, "holds a model of another shape: " + "; ".join(diffs))


def check_finished(resolved: dict, source: Path, arm: str) -> None:
    """An -ft cell's backbone trained to its end (the study compares it with the finished one)."""
    summary = runs.read_summary(source) or {}
    steps = with_defaults(flatten(resolved))["train.steps"]
    if summary.get("status") == "diverged" or not finished(summary, steps, "stop"):
        state = f"step {summary.get('steps', '?')} of {steps}, status "
        state += summary.get("status", "no summary.json")
        raise refuse(arm, source, f"is not a finished dense cell ({state}); train it first")


def starts_fresh(cfg: Config, arm: str) -> bool:
    """The arm will start from its initial weights (nothing of it on disk, or --fresh=True)."""
    d = runs.arm_dir(cfg, arm)
    return cfg.fresh or (
        checkpoint.find_last(d / "checkpoints") is None and not (d / "summary.json").is_file()
    )


def _on_disk(cfg: Config) -> Iterator[tuple[str, Config, Path, dict]]:
    """``(arm, arm config, source, its resolved config)`` of each arm that starts fresh from a
    source on disk (an -ft cell whose backbone trains first in this run has none yet)."""
    for arm in cfg.arms():
        arm_cfg = cfg.arm_config(arm)
        if not arm_cfg.train.init_from or not starts_fresh(cfg, arm):
            continue
        if is_finetune(arm) and backbone_of(arm) in cfg.cells:
            continue
        source = Path(arm_cfg.train.init_from)
        yield arm, arm_cfg, source, source_config(source_checkpoint(source, arm), source, arm)


def check_sources(cfg: Config) -> None:
    """Before any work: every source on disk exists, holds a checkpoint, is dense, has the arm's
    shape, and (an -ft cell's backbone) finished its training."""
    for arm, arm_cfg, source, resolved in _on_disk(cfg):
        check_shape(resolved, arm_cfg, arm, source)
        if is_finetune(arm):
            check_finished(resolved, source, arm)


def vocab_size_of(resolved: dict) -> int | None:
    """The vocabulary size a saved run's model has: text's ``data.vocab_size``, cells' genes + the
    special tokens (None when the config does not say)."""
    data = resolved.get("data", {})
    if data.get("vocab_size") is not None:
        return data["vocab_size"]
    return data["n_genes"] + N_SPECIAL_TOKENS if data.get("n_genes") is not None else None


def check_vocab(cfg: Config, vocab_size: int) -> None:
    """Once the run's data is open: each source on disk has its vocabulary size."""
    for arm, _, source, resolved in _on_disk(cfg):
        theirs = vocab_size_of(resolved)
        if theirs is not None and theirs != vocab_size:
            raise refuse(
                arm, source, f"has a vocabulary of {theirs} tokens, this run's data {vocab_size}"
            )


def gate_keys(model: torch.nn.Module) -> set[str]:
    """State-dict names of every gate parameter (``TokenGate``'s weight and bias)."""
    return {
        f"{name}.{p}"
        for name, m in model.named_modules()
        if isinstance(m, TokenGate)
        for p, _ in m.named_parameters()
    }


def load_weights(model: torch.nn.Module, weights: dict, arm: str, source: Path) -> None:
    """Every weight of ``weights`` into ``model``, whose gates (absent from a dense source) keep
    their initialisation; any other missing, extra or reshaped tensor is refused by name."""
    own = model.state_dict()
    missing = sorted(set(own) - set(weights) - gate_keys(model))
    extra = sorted(set(weights) - set(own))
    reshaped = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if missing or extra or reshaped:
        raise refuse(
            arm, source, f"does not fit the model: missing {missing}, extra {extra}, other "
            f"shape {reshaped}",
        )  # fmt: skip
    model.load_state_dict(weights, strict=False)


def load_init(model: torch.nn.Module, cfg: Config, arm: str) -> dict | None:
    """Load ``cfg.train.init_from``'s weights into ``model`` (just built) when it is set; the
    checks again (an -ft cell's backbone may have trained in this run), then the checkpoint's
    files verified against its manifest. Returns what provenance.json records: source,
    checkpoint, step; None without a source."""
    if not cfg.train.init_from:
        return None
    source = Path(cfg.train.init_from)
    ckpt = source_checkpoint(source, arm)
    resolved = source_config(ckpt, source, arm)
    check_shape(resolved, cfg, arm, source)
    if is_finetune(arm):
        check_finished(resolved, source, arm)
    state = checkpoint.read_state(ckpt)
    load_weights(model, state["model"], arm, source)
    return {"source": str(source), "checkpoint": str(ckpt), "step": state["step"]}
