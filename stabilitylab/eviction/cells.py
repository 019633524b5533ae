"""Trained cells of the KV-eviction study, loaded back for evaluation.

    cells = load_cells(Path("runs/kv_tiny"), expect=cfg)      # {cell: TrainedCell}, ALL_CELLS order
    val = eval_set(shards, Split.VAL, context_len=64, vocab=cells["sm-rope"].vocab)

A cell is ``<run dir>/<cell>/`` as the trainer leaves it (``stabilitylab.runs``): config.json (the
resolved config), vocab.json, summary.json and ``checkpoints/last``. Loading refuses, naming the
cell and what is wrong, before any model is built: a missing or unfinished cell, an encoder
(masked-LM) checkpoint, cells that were trained with different shared settings (a comparison
between them would not be paired), and runs trained with another model shape or data than the
config the study was started with (``expect``).

Backends: on a CPU the model is rebuilt on the eager references (``softmax-reference``,
``sigmoid-reference``), which run anywhere; on CUDA on the backend the cell trained with. The
decode loop reads only the attention kind; probes that run the model's forward pass get a
backend that works on the device.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from stabilitylab.config import (
    ALL_CELLS,
    SECTIONS,
    Config,
    ConfigError,
    backbone_of,
    cell_settings,
    from_dict,
    is_finetune,
)
from stabilitylab.data.text import EvalWindows, TokenSource
from stabilitylab.data.text.build import shards_for_files
from stabilitylab.data.text.shards import VOCAB_SIZE, open_shards
from stabilitylab.eviction.protocol import EvalSet, Split
from stabilitylab.model import Transformer
from stabilitylab.train import checkpoint
from stabilitylab.train.resume import FREE_KEYS, FREE_PREFIXES, finished, flatten, with_defaults
from stabilitylab.train.task import CompactVocab

UNSHARED_KEYS = tuple(k for k in FREE_KEYS if k != "train.steps")
"""Keys cells of one study may differ in: those a resumed run may change, except the length of
training (a comparison between cells trained for different steps is not paired)."""
CPU_BACKENDS = {"softmax": "softmax-reference", "sigmoid": "sigmoid-reference"}
OWNED_KEYS = ("arm", "backend", "model.gates", "model.position")
"""Keys each cell sets for itself (its attention kind is its backend); every other training key
must agree between the cells of one study."""
FINETUNE_KEYS = ("train.steps", "train.warmup_steps", "train.init_from")
"""Keys an -ft cell sets for itself besides ``OWNED_KEYS`` (``TrainConfig.finetune``: its own
length and warmup, its backbone's directory)."""
RESOLVED_EXTRAS = {"arm", "backend", "mixed_precision"}
"""Top-level keys config.json adds to the config (``runs.resolved_config``)."""


class StudyError(ValueError):
    """The trained cells cannot be studied as asked; the message names the cell, file or key."""


@dataclass
class TrainedCell:
    """One trained cell, ready to evaluate."""

    name: str
    config: Config
    """The config the cell trained with (its own gates and position: ``Config.arm_config``)."""
    model: Transformer
    """In eval mode, on the device it was loaded to."""
    summary: dict
    """summary.json: final validation perplexity, gate mean, steps, ..."""
    dir: Path
    backend: str
    """The attention backend the model was rebuilt on."""
    vocab: dict
    """vocab.json: with a compact vocabulary, ``model_id_to_gpt2_id``."""
    resolved: dict
    """config.json as saved (with ``data``'s facts: vocab_size, train_sha256, ...)."""

    @property
    def kind(self) -> str:
        return cell_settings(self.name)[0]

    @property
    def gated(self) -> bool:
        return cell_settings(self.name)[1]


def dense_backbone(cell: str) -> str:
    """The dense cell a gated cell is compared with: ``sig-g-rope`` (and the fine-tune control
    ``sig-g-rope-ft``, which started from it) -> ``sig-rope``."""
    return backbone_of(cell)


# ---- reading one cell -------------------------------------------------------------------------


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise StudyError(
            f"{path}: no {what}; is this a cell trained by experiments/kv_eviction.py?"
        )
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise StudyError(f"{path}: not valid JSON ({e})") from None


def arm_config_of(resolved: dict, source: Path) -> Config:
    """The ``Config`` of a saved config.json: its sections without the facts the run added."""
    d = {k: v for k, v in resolved.items() if k not in RESOLVED_EXTRAS}
    for key, cls in SECTIONS.items():
        if key in d:
            names = {f.name for f in dataclasses.fields(cls)}
            d[key] = {k: v for k, v in d[key].items() if k in names}
    try:
        return from_dict(d)
    except (ConfigError, TypeError, KeyError) as e:
        raise StudyError(f"{source}: the saved config cannot be read ({e})") from None


def _check_decoder_config(resolved: dict, cell_dir: Path) -> None:
    model = resolved.get("model", {})
    if not model.get("causal", False):
        raise StudyError(
            f"{cell_dir} is an encoder (masked-LM) checkpoint; the study needs a causal decoder "
            f"(this one has model.causal=False, data.source="
            f"{resolved.get('data', {}).get('source')}; experiments/kv_eviction.py trains them)"
        )
    if resolved.get("arm") != cell_dir.name:
        raise StudyError(
            f"{cell_dir}: config.json says arm {resolved.get('arm')!r}, the folder says "
            f"{cell_dir.name!r}; a cell's folder must keep its name"
        )


def _check_finished(cell_dir: Path, cfg: Config) -> tuple[Path, dict]:
    """The cell's last checkpoint and summary, refusing a cell that did not train to its end."""
    last = checkpoint.find_last(cell_dir / "checkpoints")
    if last is None:
        raise StudyError(
            f"{cell_dir}: no checkpoint (checkpoints/last); train the cell first "
            f"(python experiments/kv_eviction.py --cells {cell_dir.name})"
        )
    summary_path = cell_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    if summary and summary.get("status") == "diverged":
        raise StudyError(
            f"{cell_dir}: the cell diverged at step {summary.get('divergence_step')} "
            f"({summary.get('divergence_reason')}); the study needs a trained model"
        )
    if not finished(summary, cfg.train.steps, cfg.train.on_divergence):
        step = (summary or {}).get("steps", "?")
        raise StudyError(
            f"{cell_dir}: not finished (step {step} of train.steps={cfg.train.steps}, status "
            f"{(summary or {}).get('status', 'no summary.json')}); rerun the training to finish it"
        )
    return last, summary


def load_cell(cell_dir: Path, device: str | torch.device = "cpu") -> TrainedCell:
    """One cell's model with its trained weights, in eval mode on ``device``."""
    resolved = _read_json(cell_dir / "config.json", "config.json")
    _check_decoder_config(resolved, cell_dir)
    cfg = arm_config_of(resolved, cell_dir / "config.json")
    last, summary = _check_finished(cell_dir, cfg)
    state = checkpoint.read_state(last)
    device = torch.device(device)
    kind = cell_settings(cell_dir.name)[0]
    backend = resolved.get("backend") if device.type == "cuda" else CPU_BACKENDS[kind]
    vocab_size = resolved["data"].get("vocab_size") or state["model"]["tok_emb.weight"].shape[0]
    model = Transformer(cfg.model, vocab_size, cfg.data.context_len, backend)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise StudyError(f"{last}: the weights do not fit the saved config ({e})") from None
    return TrainedCell(
        name=cell_dir.name, config=cfg, model=model.to(device).eval(), summary=summary,
        dir=cell_dir, backend=backend, resolved=resolved,
        vocab=_read_json(cell_dir / "vocab.json", "vocab.json"),
    )  # fmt: skip


# ---- several cells ----------------------------------------------------------------------------


def _shared_keys(resolved: dict, cell: str) -> dict:
    """The training keys of a config.json every cell of a study must share (keys it lacks, from
    before they existed, at their defaults); an -ft cell's ``FINETUNE_KEYS`` are its own."""
    flat = with_defaults(flatten(resolved))
    own = OWNED_KEYS + (FINETUNE_KEYS if is_finetune(cell) else ())
    return {
        k: v
        for k, v in flat.items()
        if k not in own and k not in UNSHARED_KEYS and not k.startswith(FREE_PREFIXES)
    }


def _compared(key: str, cell: str) -> bool:
    """Whether ``cell``'s value of ``key`` takes part in the shared-settings check."""
    return not (is_finetune(cell) and key in FINETUNE_KEYS)


def check_shared(resolved: dict[str, dict]) -> None:
    """All cells agree on every key but their own (``OWNED_KEYS``, and an -ft cell's
    ``FINETUNE_KEYS``) and the free ones (what is logged, how they are evaluated); the error
    names each differing key and its values."""
    shared = {cell: _shared_keys(r, cell) for cell, r in resolved.items()}
    keys = sorted(set().union(*shared.values()))
    diffs = []
    for key in keys:
        values = {c: s.get(key, "<absent>") for c, s in shared.items() if _compared(key, c)}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            diffs.append(f"{key}: " + ", ".join(f"{c}={v!r}" for c, v in values.items()))
    if diffs:
        raise StudyError(
            "the cells were trained with different shared settings, so they are not a paired "
            "comparison: " + "; ".join(diffs)
        )


def check_expected(resolved: dict[str, dict], expect: Config) -> None:
    """The runs were trained with ``expect``'s model shape and data (its data keys, the vocabulary
    included); the error names the keys, the runs' values and the config's."""
    for cell, saved in resolved.items():
        want = flatten(dataclasses.asdict(expect.arm_config(cell)))
        have = flatten(saved)
        diffs = [
            f"{k}: {have.get(k, '<absent>')!r} in the runs, {v!r} in this config"
            for k, v in sorted(want.items())
            if k.startswith(("model.", "data.")) and have.get(k, "<absent>") != v
        ]
        if diffs:
            raise StudyError(
                f"the runs under {Path(expect.out_dir) / expect.name} ({cell}) differ from this "
                f"config in {'; '.join(diffs)}; pass the preset and overrides they were trained "
                "with, or another --name"
            )


def present_cells(run_dir: Path) -> list[str]:
    """Cells with a config.json under ``run_dir``, in ``ALL_CELLS`` order (the paper's 8, then
    the -ft cells)."""
    return [c for c in ALL_CELLS if (run_dir / c / "config.json").is_file()]


def load_cells(
    run_dir: Path,
    cells: Sequence[str] | None = None,
    device: str | torch.device = "cpu",
    *,
    expect: Config | None = None,
) -> dict[str, TrainedCell]:
    """The trained cells of one run dir (all present ones when ``cells`` is None), in
    ``ALL_CELLS`` order (an -ft cell loads as a gated cell). Every check reads only JSON, so a bad
    request fails before any weights load."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise StudyError(f"{run_dir}: no such run dir; train the cells first")
    unknown = [c for c in cells or () if c not in ALL_CELLS]
    if unknown:
        raise StudyError(f"unknown cell(s) {unknown}; choose from {list(ALL_CELLS)}")
    names = [c for c in ALL_CELLS if c in cells] if cells is not None else present_cells(run_dir)
    if not names:
        raise StudyError(
            f"{run_dir}: no trained cell (none of {list(ALL_CELLS)} has a config.json)"
        )
    missing = [c for c in names if not (run_dir / c).is_dir()]
    if missing:
        raise StudyError(
            f"{run_dir}: no cell {missing} (present: {present_cells(run_dir)}); train it first"
        )
    resolved = {c: _read_json(run_dir / c / "config.json", "config.json") for c in names}
    for c in names:
        _check_decoder_config(resolved[c], run_dir / c)
    check_shared(resolved)
    if expect is not None:
        check_expected(resolved, expect)
    return {c: load_cell(run_dir / c, device) for c in names}


def check_data(cells: dict[str, TrainedCell], shards) -> None:
    """The shards are the ones the cells trained on (the train split's sha256 in config.json)."""
    have = shards.meta.get("splits", {}).get("train", {}).get("sha256")
    for cell in cells.values():
        saved = cell.resolved.get("data", {}).get("train_sha256")
        if saved and have and saved != have:
            raise StudyError(
                f"{cell.dir}: trained on a train split with sha256 {saved[:12]}..., the shards at "
                f"{shards.path} have {have[:12]}...; evaluate on the data the cells trained on"
            )


# ---- evaluation windows in the model's ids ----------------------------------------------------


class ModelIdWindows(TokenSource):
    """Windows of GPT-2 ids read as a model's ids (the compact vocabulary renumbers them)."""

    def __init__(self, windows: EvalWindows, index_V: np.ndarray):
        self.windows, self.index_V = windows, index_V
        self.context_len = windows.context_len

    def __len__(self) -> int:
        return len(self.windows)

    def sample(self, index: int) -> np.ndarray:
        return self.index_V[self.windows.sample(index)]


def _in_model_ids(windows: EvalWindows, tokens: np.ndarray, vocab: dict, what: str):
    """``windows`` read in a model's ids; a token the model cannot read is refused, naming
    ``what`` (other data than the cells trained on, or another vocabulary)."""
    gpt2_ids = vocab.get("model_id_to_gpt2_id")
    if gpt2_ids is None:
        if tokens.size and int(tokens.max()) >= VOCAB_SIZE:
            raise StudyError(
                f"{what} holds token id {int(tokens.max())} >= {VOCAB_SIZE}: another vocabulary "
                "than the cells' GPT-2 BPE"
            )
        return windows
    index_V = CompactVocab(np.asarray(gpt2_ids, dtype=np.int64)).index_V
    known_N = tokens < index_V.shape[0]
    known_N[known_N] = index_V[tokens[known_N]] >= 0
    unknown = np.unique(tokens[~known_N])
    if unknown.size:
        raise StudyError(
            f"{what} holds {unknown.size} token id(s) the trained models' compact vocabulary "
            f"lacks (e.g. {unknown[:5].tolist()}): other data than the cells trained on"
        )
    return ModelIdWindows(windows, index_V)


def heldout_set(study, context_len: int, vocab: dict) -> tuple[EvalSet | None, str]:
    """The held-out text of ``study.heldout_files`` (every token of the files) or
    ``study.heldout_shards`` (that folder's test split) in the cells' ids, tagged test (it is
    scored at the tau* frozen on validation), and its name; ``(None, "")`` without one."""
    if study.heldout_files:
        shards = shards_for_files(study.heldout_files)
        tokens = np.concatenate([np.asarray(shards.split(s)) for s in ("train", "val", "test")])
        name = "files " + ", ".join(Path(f).name for f in study.heldout_files)
    elif study.heldout_shards:
        shards = open_shards(
            study.heldout_shards, "give a folder written by experiments/prepare_text.py"
        )
        tokenizer = shards.meta.get("tokenizer", {})
        if tokenizer.get("name", "r50k_base") != "r50k_base":
            raise StudyError(
                f"study.heldout_shards {study.heldout_shards}: tokenised with "
                f"{tokenizer.get('name')!r}, the cells read GPT-2 BPE (r50k_base)"
            )
        tokens, name = np.asarray(shards.test), f"shards {study.heldout_shards} (test split)"
    else:
        return None, ""
    windows = EvalWindows(tokens, context_len, name="held-out")
    what = f"the held-out text ({name})"
    return EvalSet(Split.TEST, _in_model_ids(windows, tokens, vocab, what)), name


def eval_set(shards, split: Split, context_len: int, vocab: dict) -> EvalSet:
    """``EvalSet.from_shards`` in the ids of a model with ``vocab`` (its vocab.json). A token the
    model's vocabulary lacks means other data than it trained on: refused, naming the split."""
    base = EvalSet.from_shards(shards, split, context_len)
    gpt2_ids = vocab.get("model_id_to_gpt2_id")
    if gpt2_ids is None:
        return base
    index_V = CompactVocab(np.asarray(gpt2_ids, dtype=np.int64)).index_V
    tokens = np.asarray(shards.split(Split(split).value))
    unknown = np.unique(tokens[index_V[tokens] < 0])
    if unknown.size:
        raise StudyError(
            f"the {Split(split).value} split of {shards.path} holds {unknown.size} token id(s) "
            f"the trained models' compact vocabulary lacks (e.g. {unknown[:5].tolist()}): "
            "other data than the cells trained on"
        )
    return EvalSet(base.split, ModelIdWindows(base.windows, index_V))
