"""Cells for masked-token training: synthetic generator, .h5ad loader, padded masked batches.

    source = build_source(cfg.data, seed)
    batch = make_batch(source, range(step * B, (step + 1) * B), context_len=cfg.data.context_len,
                       mask_prob=cfg.data.mask_prob, seed=seed)

A batch depends only on the seed and the global sample indices, never on the process count.
"""

from __future__ import annotations

import warnings

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
    "FewCellsWarning",
    "SyntheticSource",
    "build_source",
    "make_batch",
    "rank_value_order",
]


def build_source(cfg: DataConfig, seed: int, *, global_batch: int | None = None) -> CellSource:
    """The cell source ``cfg.source`` names; data problems raise ``DataError`` here, before training.

    With ``global_batch``, a source holding fewer cells than one batch gets a warning (below two
    cells, always): every batch then repeats the same cells, and the run measures memorisation.
    """
    if cfg.source == "synthetic":
        source: CellSource = SyntheticSource(cfg, seed)
        where = "synthetic data"
    elif cfg.source == "h5ad":
        from stabilitylab.data.h5ad import H5adSource

        if not cfg.h5ad_path:
            raise DataError("data.h5ad_path is required when data.source=h5ad")
        source = H5adSource(cfg.h5ad_path, seed, context_len=cfg.context_len, layer=cfg.h5ad_layer)
        where = f"h5ad file {cfg.h5ad_path}"
    else:
        raise DataError(f"unknown data.source {cfg.source!r}; choose 'synthetic' or 'h5ad'")
    warn_if_few_cells(len(source), global_batch, where)
    return source


def warn_if_few_cells(n_cells: int, global_batch: int | None, where: str) -> None:
    """One warning when ``n_cells`` is below two or below one global batch."""
    need = max(2, global_batch or 0)
    if n_cells < need:
        batch = f" of {global_batch}" if global_batch else ""
        warnings.warn(
            f"{where}: only {n_cells} usable cell(s), fewer than one global batch{batch}; "
            "every batch repeats the same cells",
            FewCellsWarning,
            stacklevel=3,
        )


class FewCellsWarning(UserWarning):
    """The data has fewer cells than one batch needs; training would repeat them."""
