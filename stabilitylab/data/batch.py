"""Cells -> right-padded masked-token batches, deterministic in (seed, global sample index).

Layout: ``tokens_BT`` holds token ids (gene g -> g + N_SPECIAL_TOKENS, PAD=0 after the cell),
``labels_BT`` the original token at predicted positions and -100 elsewhere (padding included),
``lengths_B`` the valid tokens per row. T is the longest cell of the batch rounded up to
``pad_to_multiple``.

Masking (BERT): each valid position is selected with probability ``mask_prob``, at least one per
cell; a selected token becomes MASK (80%), a uniformly random gene token (10%) or stays (10%).
Each cell draws from its own ``default_rng([seed, index, MASK_STREAM])``, so a row of the batch is
the same whichever process or micro-batch builds it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from stabilitylab.config import N_SPECIAL_TOKENS
from stabilitylab.data.source import CellSource, check_index, check_seed

PAD_ID = 0
MASK_ID = 1
CLS_ID = 2
IGNORE_LABEL = -100
_MASK_STREAM = 2


@dataclass
class Batch:
    tokens_BT: torch.Tensor
    labels_BT: torch.Tensor
    lengths_B: torch.Tensor
    indices: list[int]
    n_masked: int = field(default=-1)
    """Positions with a label; counted on the host when built, so reading it never syncs."""

    def __post_init__(self) -> None:
        if self.n_masked < 0:
            self.n_masked = int((self.labels_BT != IGNORE_LABEL).sum())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            tokens_BT=self.tokens_BT.to(device, non_blocking=non_blocking),
            labels_BT=self.labels_BT.to(device, non_blocking=non_blocking),
            lengths_B=self.lengths_B.to(device, non_blocking=non_blocking),
            indices=list(self.indices),
            n_masked=self.n_masked,
        )


def mask_tokens(
    rng: np.random.Generator, tokens_N: np.ndarray, mask_prob: float, n_genes: int
) -> tuple[np.ndarray, np.ndarray]:
    """BERT masking of one cell's tokens: returns (inputs_N, labels_N), labels -100 if unpicked."""
    n = tokens_N.shape[0]
    picked_N = rng.random(n) < mask_prob
    if not picked_N.any():
        picked_N[rng.integers(n)] = True
    pos = np.flatnonzero(picked_N)
    action = rng.random(pos.shape[0])
    random_tokens = rng.integers(N_SPECIAL_TOKENS, N_SPECIAL_TOKENS + n_genes, pos.shape[0])
    inputs_N = tokens_N.copy()
    inputs_N[pos[action < 0.8]] = MASK_ID
    swap = (action >= 0.8) & (action < 0.9)
    inputs_N[pos[swap]] = random_tokens[swap]
    labels_N = np.full(n, IGNORE_LABEL, dtype=np.int64)
    labels_N[pos] = tokens_N[pos]
    return inputs_N, labels_N


def make_batch(
    source: CellSource,
    indices: Sequence[int],
    *,
    context_len: int,
    mask_prob: float,
    seed: int,
    pad_to_multiple: int = 1,
) -> Batch:
    """Cells ``indices`` of ``source`` as one padded, masked batch (CPU tensors)."""
    indices = [check_index(i) for i in indices]
    if not indices:
        raise ValueError("make_batch needs at least one index")
    seed = check_seed(seed)
    context_len = operator.index(context_len)
    pad_to_multiple = operator.index(pad_to_multiple)
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    if pad_to_multiple < 1 or context_len % pad_to_multiple:
        # Checked up front: rounding a long cell up past context_len would overrun the model's
        # position table only on the batches that happen to hold one.
        raise ValueError(
            f"pad_to_multiple must be >= 1 and divide context_len={context_len}, got {pad_to_multiple}"
        )

    rows_inputs, rows_labels = [], []
    for index in indices:
        genes_N = source.cell(index)[:context_len]
        if genes_N.shape[0] == 0:
            raise ValueError(f"cell {index} of the source is empty")
        rng = np.random.default_rng([seed, index, _MASK_STREAM])
        inputs_N, labels_N = mask_tokens(rng, genes_N + N_SPECIAL_TOKENS, mask_prob, source.n_genes)
        rows_inputs.append(inputs_N)
        rows_labels.append(labels_N)

    lengths = [r.shape[0] for r in rows_inputs]
    T = -(-max(lengths) // pad_to_multiple) * pad_to_multiple
    tokens_BT = np.full((len(indices), T), PAD_ID, dtype=np.int64)
    labels_BT = np.full((len(indices), T), IGNORE_LABEL, dtype=np.int64)
    for b, (inp, lab) in enumerate(zip(rows_inputs, rows_labels, strict=True)):
        tokens_BT[b, : inp.shape[0]] = inp
        labels_BT[b, : lab.shape[0]] = lab
    return Batch(
        tokens_BT=torch.from_numpy(tokens_BT),
        labels_BT=torch.from_numpy(labels_BT),
        lengths_B=torch.tensor(lengths, dtype=torch.int64),
        indices=indices,
        n_masked=int((labels_BT != IGNORE_LABEL).sum()),
    )


def stack_batches(batches: Sequence[Batch]) -> Batch:
    """Batches of the same task as one batch, right-padded to the longest row (PAD, labels -100).

    Row ``b`` keeps its tokens, labels and length exactly; only the padding after it may grow.
    """
    if not batches:
        raise ValueError("stack_batches needs at least one batch")
    rows = sum(b.tokens_BT.shape[0] for b in batches)
    T = max(b.tokens_BT.shape[1] for b in batches)
    first = batches[0]
    tokens_BT = first.tokens_BT.new_full((rows, T), PAD_ID)
    labels_BT = first.labels_BT.new_full((rows, T), IGNORE_LABEL)
    row = 0
    for b in batches:
        n, t = b.tokens_BT.shape
        tokens_BT[row : row + n, :t] = b.tokens_BT
        labels_BT[row : row + n, :t] = b.labels_BT
        row += n
    return Batch(
        tokens_BT=tokens_BT,
        labels_BT=labels_BT,
        lengths_B=torch.cat([b.lengths_B for b in batches]),
        indices=[i for b in batches for i in b.indices],
        n_masked=sum(b.n_masked for b in batches),
    )
