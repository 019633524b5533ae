"""Cells for masked-token training: synthetic generator, .h5ad loader, padded masked batches.

    source = build_source(cfg.data, seed)
    batch = make_batch(source, range(step * B, (step + 1) * B), context_len=cfg.data.context_len,
                       mask_prob=cfg.data.mask_prob, seed=seed)

A batch depends only on the seed and the global sample indices, never on the process count.
"""

from __future__ import annotations

from stabilitylab.config import DataConfig
from stabilitylab.data.batch import CLS_ID, IGNORE_LABEL, MASK_ID, PAD_ID, Batch, make_batch
from stabilitylab.data.source import CellSource, DataError, rank_value_order
from stabilitylab.data.synthetic import SyntheticSource

__all__ = [
    "CLS_ID",
    "IGNORE_LABEL",
    "MASK_ID",
    "PAD_ID",
    "Batch",
    "CellSource",
    "DataError",
    "SyntheticSource",
    "build_source",
    "make_batch",
    "rank_value_order",
]


def build_source(cfg: DataConfig, seed: int) -> CellSource:
    """The cell source ``cfg.source`` names; data problems raise ``DataError`` here, before training."""
    if cfg.source == "synthetic":
        return SyntheticSource(cfg, seed)
    if cfg.source == "h5ad":
        from stabilitylab.data.h5ad import H5adSource

        if not cfg.h5ad_path:
            raise DataError("data.h5ad_path is required when data.source=h5ad")
        return H5adSource(cfg.h5ad_path, seed, context_len=cfg.context_len)
    raise ValueError(f"unknown data.source {cfg.source!r}; choose 'synthetic' or 'h5ad'")
