"""Cells from an AnnData ``.h5ad`` count matrix, rank-value encoded as Geneformer does.

    pip install stabilitylab[bio]      # anndata, imported only when this source is built

For cell c and gene g with count ``x_cg``::

    score_cg = (x_cg / total_c * 1e4) / median_g,    median_g = median over cells of the
                                                     non-zero values of x_.g / total_. * 1e4

and the cell's tokens are its genes with ``x_cg > 0`` sorted by ``score_cg`` (highest first,
ties by gene id), truncated to ``context_len``. Dividing by the cell total does not change the
order within a cell; it matters for ``median_g``, which is taken over size-normalised cells.

The matrix is X by default; ``layer="raw"`` reads ``.raw.X`` (and its genes), any other name an
entry of ``.layers``. Limits: the whole matrix is read into memory (no backed mode); it must hold
non-negative counts or normalised expression (dense, or scipy CSR/CSC); scaled data (negative
values) is refused, naming a layer of the file without negative values when there is one.
Cells with no expressed gene are skipped and counted in ``skipped_cells``. Sample index i maps
to epoch ``i // len(source)`` and, within it, to a cell of a seed-dependent permutation drawn
fresh per epoch.
"""

from __future__ import annotations

import os
import warnings

import numpy as np

from stabilitylab.data.source import (
    CellSource,
    DataError,
    check_index,
    check_seed,
    rank_value_order,
)

SIZE_FACTOR_TARGET = 1e4
_ORDER_STREAM = 3


def _import_anndata():
    try:
        import anndata
    except ImportError as e:
        raise ImportError("reading .h5ad files needs anndata: pip install stabilitylab[bio]") from e
    return anndata


def nonzero_median_per_column(indptr_G: np.ndarray, values_N: np.ndarray) -> np.ndarray:
    """Median of the stored values of each column of a CSC matrix; 1.0 for an empty column.

    One sort of (column, value) pairs instead of a Python loop over tens of thousands of genes;
    ``values_N`` must already hold only the non-zero entries.
    """
    n_cols = indptr_G.shape[0] - 1
    n_per_col = np.diff(indptr_G)
    col_N = np.repeat(np.arange(n_cols), n_per_col)
    sorted_N = values_N[np.lexsort((values_N, col_N))]
    median_G = np.ones(n_cols, dtype=np.float64)
    has = n_per_col > 0
    start = indptr_G[:-1][has]
    n = n_per_col[has]
    median_G[has] = 0.5 * (sorted_N[start + (n - 1) // 2] + sorted_N[start + n // 2])
    return median_G


def _matrix(adata, layer: str, path: str):
    """``(matrix, its name for messages, gene names)`` of the layer the config names."""
    if layer == "X":
        return adata.X, "X", adata.var_names
    if layer == "raw":
        if adata.raw is None:
            raise DataError(f"h5ad file {path} has no .raw (data.h5ad_layer=raw)")
        return adata.raw.X, ".raw.X", adata.raw.var_names
    if layer not in adata.layers:
        raise DataError(
            f"h5ad file {path} has no layer {layer!r} (data.h5ad_layer); it has X, "
            + ("raw, " if adata.raw is not None else "")
            + f"and layers {list(adata.layers)}"
        )
    return adata.layers[layer], f"layers[{layer!r}]", adata.var_names


def _holds_negatives(M) -> bool:
    import scipy.sparse as sp

    values = M.data if sp.issparse(M) else np.asarray(M)
    return bool(values.size) and bool(np.nanmin(values) < 0)


def _count_layers(adata, skip: str) -> list[str]:
    """The ``data.h5ad_layer`` values, other than ``skip``, whose matrix has no negative value."""
    names = ["X"] if skip != "X" and not _holds_negatives(adata.X) else []
    if skip != "raw" and adata.raw is not None and not _holds_negatives(adata.raw.X):
        names.append("raw")
    names += [k for k in adata.layers if k != skip and not _holds_negatives(adata.layers[k])]
    return names


def _csr_counts(adata, layer: str, path: str):
    """The chosen matrix as float64 CSR without stored zeros, checked; and its gene names."""
    import scipy.sparse as sp

    M, what, var_names = _matrix(adata, layer, path)
    if M is None:
        raise DataError(f"h5ad file {path} has no expression matrix {what}")
    if M.shape[0] == 0 or M.shape[1] == 0:
        raise DataError(f"h5ad file {path} has an empty {what} of shape {M.shape}")
    if not (sp.issparse(M) or isinstance(M, np.ndarray)):
        raise DataError(
            f"h5ad file {path}: {what} of type {type(M).__name__} is not supported "
            "(dense array or scipy CSR/CSC)"
        )
    M = sp.csr_matrix(M, dtype=np.float64)
    M.eliminate_zeros()
    if M.nnz == 0:
        raise DataError(f"h5ad file {path}: {what} has no expression values (all zero)")
    if not np.all(np.isfinite(M.data)):
        raise DataError(f"h5ad file {path}: {what} holds NaN or infinite values")
    if np.any(M.data < 0):
        # Scaled or log-normalised data: the counts are often kept beside it.
        other = _count_layers(adata, skip=layer)
        hint = ""
        if other:
            name = {"X": "X", "raw": ".raw.X"}.get(other[0], f"layers[{other[0]!r}]")
            hint = f"; {name} has none (counts?): use --data.h5ad_layer={other[0]}"
        raise DataError(
            f"h5ad file {path}: {what} holds negative values (scaled or log-normalised?); "
            f"counts expected{hint}"
        )
    return M, [str(g) for g in var_names]


class H5adSource(CellSource):
    """Rank-value encoded cells of one ``.h5ad`` file."""

    def __init__(self, path: str | os.PathLike, seed: int, *, context_len: int, layer: str = "X"):
        self.path = os.fspath(path)
        self.seed = check_seed(seed)
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        self.context_len = int(context_len)
        self.layer = layer
        if not os.path.isfile(self.path):
            raise DataError(f"h5ad file not found: {self.path}")
        anndata = _import_anndata()
        import scipy.sparse as sp

        try:
            adata = anndata.read_h5ad(self.path)
        except Exception as e:  # h5py / anndata raise many types for a corrupt file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"cannot read h5ad file {self.path} (not an AnnData file?): {first}"
            ) from None
        X, self.gene_names = _csr_counts(adata, layer, self.path)
        n_cells, self.n_genes = X.shape

        total_C = np.asarray(X.sum(axis=1)).ravel()
        kept_C = np.flatnonzero(total_C > 0)
        self.skipped_cells = int(n_cells - kept_C.shape[0])
        if self.skipped_cells:
            warnings.warn(
                f"{self.path}: skipped {self.skipped_cells} of {n_cells} cells with no expressed genes",
                stacklevel=2,
            )
        X = X[kept_C]
        X = sp.csr_matrix(sp.diags(SIZE_FACTOR_TARGET / total_C[kept_C]) @ X)
        X.sort_indices()
        csc = X.tocsc()
        self.median_G = nonzero_median_per_column(csc.indptr, csc.data)
        self._indptr, self._indices, self._values = X.indptr, X.indices.astype(np.int64), X.data
        self._cells = int(kept_C.shape[0])
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self._cells

    def row_of(self, index: int) -> int:
        """Row of the kept cells that global sample ``index`` reads."""
        epoch, within = divmod(check_index(index), self._cells)
        order = self._orders.get(epoch)
        if order is None:
            # Two epochs cached: a batch that straddles an epoch boundary alternates between them.
            if len(self._orders) >= 2:
                self._orders.pop(min(self._orders))
            order = np.random.default_rng([self.seed, epoch, _ORDER_STREAM]).permutation(
                self._cells
            )
            self._orders[epoch] = order
        return int(order[within])

    def cell(self, index: int) -> np.ndarray:
        row = self.row_of(index)
        lo, hi = self._indptr[row], self._indptr[row + 1]
        genes_N = self._indices[lo:hi]
        scores_N = self._values[lo:hi] / self.median_G[genes_N]
        return rank_value_order(genes_N, scores_N, self.n_genes, self.context_len)
