"""What a run trains on, per task, behind one interface for the loop.

    data = cell_task(source, cfg)     # cells: masked tokens, the stress study's encoder
    data = text_task(cfg)             # text: next tokens, the KV-eviction study's decoder

Both give the loader its micro-batch function (global sample indices -> ``Batch``), the model its
vocabulary size, the run dir its ``vocab.json`` and the facts config.json records under ``data``.
Text adds the fixed validation batches: ``EvalWindows`` over the val split, ``train.micro_batch``
windows each, the first ``telemetry.val_batches`` of them (0 = all), the same at every pass.

Labels of a text batch are already aligned with the logits (``make_lm_batch``: position t's target
is token t + 1), so the masked-token loss code computes the next-token loss unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from stabilitylab.config import N_SPECIAL_TOKENS, Config, DataConfig
from stabilitylab.data.batch import CLS_ID, IGNORE_LABEL, MASK_ID, PAD_ID, Batch
from stabilitylab.data.loader import MicroBatchFn, masked_cells
from stabilitylab.data.source import CellSource
from stabilitylab.data.text import (
    EOT_ID,
    SPLITS,
    VOCAB_SIZE,
    EvalWindows,
    Shards,
    TokenSource,
    TrainWindows,
    make_lm_batch,
    open_corpus,
    open_sample,
    shards_for_files,
    shards_for_hf,
)


@dataclass
class TaskData:
    """One task's data, as the loop uses it."""

    make_micro: MicroBatchFn
    """Global sample indices -> one training micro-batch (the loader calls it)."""
    vocab_size: int
    vocab: dict
    """What vocab.json of each run dir holds: how token ids read."""
    facts: dict
    """Keys config.json records under ``data`` (what the data turned out to be)."""
    val: list[Batch] = field(default_factory=list)
    """Fixed validation batches, in order (text); none for cells."""


def cell_task(source: CellSource, cfg: Config) -> TaskData:
    """Masked cells of ``source``; vocab.json maps token ids to gene names."""
    vocab = {
        "special_tokens": {"<pad>": PAD_ID, "<mask>": MASK_ID, "<cls>": CLS_ID},
        "gene_token_offset": N_SPECIAL_TOKENS,
        "genes": list(source.gene_names),
    }
    return TaskData(
        make_micro=masked_cells(source, cfg),
        vocab_size=source.n_genes + N_SPECIAL_TOKENS,
        vocab=vocab,
        facts={"n_genes": source.n_genes},  # the source's vocabulary, not the default
    )


# ---- text -------------------------------------------------------------------------------------


def open_text(data: DataConfig) -> Shards:
    """The token shards ``data.text`` names; a missing corpus names the command that builds it."""
    if data.text == "corpus":
        return open_corpus()
    if data.text == "sample":
        return open_sample()
    if data.text == "files":
        return shards_for_files(data.text_files)
    return shards_for_hf(data.hf_dataset, split=data.hf_split, text_column=data.hf_text_column)


class CompactVocab:
    """GPT-2 ids -> the ids ``0 .. n-1`` of the ``n`` distinct ids in ``ids_N`` (id order).

    End-of-text is always in it: ``make_lm_batch`` pads inputs with it."""

    def __init__(self, ids_N: np.ndarray):
        self.gpt2_ids_N = np.union1d(ids_N, [EOT_ID]).astype(np.int64)
        self.index_V = np.full(VOCAB_SIZE, -1, dtype=np.int64)
        self.index_V[self.gpt2_ids_N] = np.arange(self.gpt2_ids_N.shape[0])
        self._index_V = torch.from_numpy(self.index_V)

    def __len__(self) -> int:
        return int(self.gpt2_ids_N.shape[0])

    def __call__(self, b: Batch) -> Batch:
        labels_BT = b.labels_BT
        keep_BT = labels_BT != IGNORE_LABEL
        labels_BT = torch.where(keep_BT, self._index_V[labels_BT.clamp(min=0)], labels_BT)
        return Batch(
            tokens_BT=self._index_V[b.tokens_BT],
            labels_BT=labels_BT,
            lengths_B=b.lengths_B,
            indices=b.indices,
            n_masked=b.n_masked,
        )


@dataclass
class NextTokenBatches:
    """``make_micro`` of text: windows of ``windows`` as a next-token batch, ids mapped when the
    vocabulary is compact. A class, not a closure, so DataLoader workers can receive it."""

    windows: TokenSource
    context_len: int
    compact: CompactVocab | None = None

    def __call__(self, indices: Sequence[int]) -> Batch:
        b = make_lm_batch(self.windows, indices, self.context_len)
        return self.compact(b) if self.compact is not None else b


def _val_batches(shards: Shards, cfg: Config, compact: CompactVocab | None) -> list[Batch]:
    if not cfg.telemetry.val_every:
        return []
    T = cfg.data.context_len
    windows = EvalWindows(shards.val, T, name=f"val ({shards.path})")
    groups = windows.batches(cfg.train.micro_batch)
    if cfg.telemetry.val_batches:
        groups = groups[: cfg.telemetry.val_batches]
    make = NextTokenBatches(windows, T, compact)
    return [make(idx) for idx in groups]


def text_task(cfg: Config, shards: Shards | None = None) -> TaskData:
    """Next-token windows of the train split (``TrainWindows``: each epoch a new order and shift,
    from the seed) and the fixed validation batches."""
    shards = shards if shards is not None else open_text(cfg.data)
    T = cfg.data.context_len
    train = TrainWindows(shards.train, T, cfg.train.seed, name=f"train ({shards.path})")
    compact = None
    if cfg.data.vocab == "compact":
        compact = CompactVocab(np.unique(np.concatenate([shards.split(s) for s in SPLITS])))
    vocab = {"tokenizer": "r50k_base (GPT-2 BPE)", "eot": EOT_ID}
    if compact is not None:
        vocab["model_id_to_gpt2_id"] = compact.gpt2_ids_N.tolist()
        vocab["eot"] = int(compact.index_V[EOT_ID])
    facts = {
        "vocab_size": len(compact) if compact is not None else VOCAB_SIZE,
        "train_tokens": int(shards.train.shape[0]),
        "train_sha256": shards.sha256["train"],  # the file's, as open_shards computed it
    }
    return TaskData(
        make_micro=NextTokenBatches(train, T, compact),
        vocab_size=facts["vocab_size"],
        vocab=vocab,
        facts=facts,
        val=_val_batches(shards, cfg, compact),
    )
