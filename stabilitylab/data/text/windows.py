"""Token windows for next-token training and evaluation, and the LM batch built from them.

Training (``TrainWindows``): a split of ``n`` tokens is cut into ``n // W`` non-overlapping
windows of ``W = context_len + 1`` tokens. Sample index ``i`` falls in epoch ``i // len`` and
takes window ``perm_e[i % len]`` shifted by ``s_e`` tokens, where the permutation ``perm_e`` and
the shift ``s_e in [0, n - len * W]`` come from ``default_rng([seed, e, stream])``. So every
token is seen once per epoch, window borders move between epochs, and a window depends on
(seed, index) alone — never on the process count or what was read before (as the cell sources).

Evaluation (``EvalWindows``): fixed, ordered windows with stride ``context_len``: window k holds
tokens ``[k T, k T + T + 1)``, so its ``T`` targets are tokens ``k T + 1 .. k T + T`` and the
windows' targets tile the split exactly once (the last window is shorter when T does not
divide ``n - 1``). Perplexity over them is the split's perplexity at context ``<= T``.

Batch (``make_lm_batch``): ``tokens_BT`` = window[:-1], ``labels_BT`` = window[1:], rows
right-padded with the end-of-text id and ``IGNORE_LABEL``; ``lengths_B`` = valid inputs per row
(``context_len`` for every training row).
"""

from __future__ import annotations

import abc
import operator
from collections.abc import Sequence

import numpy as np
import torch

from stabilitylab.data.batch import IGNORE_LABEL, Batch
from stabilitylab.data.source import DataError, check_index, check_seed
from stabilitylab.data.text.shards import EOT_ID

_ORDER_STREAM = 5
PAD_ID = EOT_ID
"""Input id on padded positions; any id works, since their labels are ignored."""


def _check_context_len(context_len: object) -> int:
    T = operator.index(context_len)
    if T < 1:
        raise ValueError(f"context_len must be >= 1, got {T}")
    return T


class TokenSource(abc.ABC):
    """Token windows of at most ``context_len + 1`` ids addressed by a sample index."""

    context_len: int

    @abc.abstractmethod
    def __len__(self) -> int:
        """Windows per epoch (training) or in all (evaluation)."""

    @abc.abstractmethod
    def sample(self, index: int) -> np.ndarray:
        """One window, int64, ``2 <= len <= context_len + 1``."""


class TrainWindows(TokenSource):
    def __init__(self, tokens_N: np.ndarray, context_len: int, seed: int, name: str = "train"):
        self.context_len = _check_context_len(context_len)
        self.seed = check_seed(seed)
        self.tokens_N = tokens_N
        W = self.context_len + 1
        n = int(tokens_N.shape[0])
        if n < W:
            raise DataError(
                f"{name} split has {n} tokens, fewer than one window of context_len + 1 = {W}"
            )
        self.n_windows = n // W
        self.max_shift = n - self.n_windows * W
        self._epoch_cache: tuple[int, int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.n_windows

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch, _ORDER_STREAM])
            shift = int(rng.integers(0, self.max_shift + 1))
            self._epoch_cache = (epoch, shift, rng.permutation(self.n_windows))
        return self._epoch_cache[1], self._epoch_cache[2]

    def sample(self, index: int) -> np.ndarray:
        epoch, j = divmod(check_index(index), self.n_windows)
        shift, perm = self._epoch(epoch)
        W = self.context_len + 1
        start = shift + int(perm[j]) * W
        return np.asarray(self.tokens_N[start : start + W], dtype=np.int64)


class EvalWindows(TokenSource):
    def __init__(self, tokens_N: np.ndarray, context_len: int, name: str = "val"):
        self.context_len = _check_context_len(context_len)
        self.tokens_N = tokens_N
        n = int(tokens_N.shape[0])
        if n < 2:
            raise DataError(f"{name} split has {n} tokens; evaluation needs at least 2")
        self.n_windows = -(-(n - 1) // self.context_len)

    def __len__(self) -> int:
        return self.n_windows

    def sample(self, index: int) -> np.ndarray:
        k = check_index(index)
        if k >= self.n_windows:
            raise ValueError(f"evaluation window {k} out of range: there are {self.n_windows}")
        start = k * self.context_len
        return np.asarray(self.tokens_N[start : start + self.context_len + 1], dtype=np.int64)

    def batches(self, batch_size: int) -> list[range]:
        """The windows' indices in order, ``batch_size`` at a time (the last batch may be short)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return [
            range(lo, min(lo + batch_size, self.n_windows))
            for lo in range(0, self.n_windows, batch_size)
        ]


def make_lm_batch(source: TokenSource, indices: Sequence[int], context_len: int) -> Batch:
    """Windows ``indices`` of ``source`` as one next-token batch (CPU tensors, int64)."""
    indices = [check_index(i) for i in indices]
    if not indices:
        raise ValueError("make_lm_batch needs at least one index")
    T = _check_context_len(context_len)
    rows = [source.sample(i)[: T + 1] for i in indices]
    for i, row in zip(indices, rows, strict=True):
        if row.shape[0] < 2:
            raise ValueError(f"window {i} has {row.shape[0]} token(s); a target needs 2")
    lengths = [row.shape[0] - 1 for row in rows]
    tokens_BT = np.full((len(rows), max(lengths)), PAD_ID, dtype=np.int64)
    labels_BT = np.full((len(rows), max(lengths)), IGNORE_LABEL, dtype=np.int64)
    for b, row in enumerate(rows):
        tokens_BT[b, : lengths[b]] = row[:-1]
        labels_BT[b, : lengths[b]] = row[1:]
    return Batch(
        tokens_BT=torch.from_numpy(tokens_BT),
        labels_BT=torch.from_numpy(labels_BT),
        lengths_B=torch.tensor(lengths, dtype=torch.int64),
        indices=indices,
        n_masked=sum(lengths),
    )
