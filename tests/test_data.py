"""Data layer: synthetic generator, rank-value encoding, masking/padding, .h5ad loader, learnability."""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings

import numpy as np
import pytest
import torch

from stabilitylab.config import N_SPECIAL_TOKENS, ConfigError, DataConfig, proxy, smoke
from stabilitylab.data import (
    IGNORE_LABEL,
    MASK_ID,
    PAD_ID,
    Batch,
    DataError,
    FewCellsWarning,
    build_source,
    make_batch,
    rank_value_order,
)
from stabilitylab.data.synthetic import SyntheticSource, sample_zinb_nonzero
from stabilitylab.model import Transformer, masked_lm_loss_sum, vocab_size_for

SMOKE = smoke().data


@pytest.fixture(scope="module")
def smoke_source() -> SyntheticSource:
    return build_source(SMOKE, seed=7)


def _rows(batch: Batch) -> list[tuple[list[int], list[int]]]:
    return [
        (batch.tokens_BT[b, :n].tolist(), batch.labels_BT[b, :n].tolist())
        for b, n in enumerate(batch.lengths_B.tolist())
    ]


# ---- determinism -------------------------------------------------------------------------------


def test_same_seed_and_index_give_the_same_cell_and_mask(smoke_source):
    again = build_source(SMOKE, seed=7)
    other = build_source(SMOKE, seed=8)
    for i in [0, 5, 123_456_789, 2**39 + 3]:
        np.testing.assert_array_equal(smoke_source.cell(i), again.cell(i))
    assert any(not np.array_equal(smoke_source.cell(i), other.cell(i)) for i in range(4)), (
        "a different seed should build a different world"
    )
    kw = dict(context_len=SMOKE.context_len, mask_prob=0.15, seed=3)
    a = make_batch(smoke_source, [4, 9, 2], **kw)
    b = make_batch(again, [4, 9, 2], **kw)
    assert torch.equal(a.tokens_BT, b.tokens_BT) and torch.equal(a.labels_BT, b.labels_BT)
    c = make_batch(smoke_source, [4, 9, 2], **{**kw, "seed": 4})
    assert not torch.equal(a.labels_BT, c.labels_BT), "the mask seed should change the mask"


def test_cell_does_not_depend_on_what_was_generated_before(smoke_source):
    fresh = build_source(SMOKE, seed=7)
    first = fresh.cell(41)
    for i in range(40):
        smoke_source.cell(i)
    np.testing.assert_array_equal(smoke_source.cell(41), first)


def test_process_slicing_gives_the_same_global_batch(smoke_source):
    step, global_batch = 5, 12
    indices = list(range(step * global_batch, (step + 1) * global_batch))
    kw = dict(context_len=SMOKE.context_len, mask_prob=0.15, seed=11)
    whole = _rows(make_batch(smoke_source, indices, **kw))
    for n_proc in (2, 3, 4):
        per_proc = global_batch // n_proc
        sliced = []
        for rank in range(n_proc):
            part = indices[rank * per_proc : (rank + 1) * per_proc]
            # micro-batches of 1 and 2 within each process
            for j in range(0, len(part), 2):
                sliced += _rows(make_batch(smoke_source, part[j : j + 2], **kw))
        assert sliced == whole, f"{n_proc} processes built a different global batch"


# ---- rank-value encoding -------------------------------------------------------------------------


def test_rank_value_order_sorts_by_score_and_breaks_ties_by_gene_id():
    genes = np.array([7, 3, 9, 1, 4], dtype=np.int64)
    scores = np.array([2.0, 5.0, 2.0, 0.5, 5.0])
    np.testing.assert_array_equal(rank_value_order(genes, scores, 10, 10), [3, 4, 7, 9, 1])
    np.testing.assert_array_equal(rank_value_order(genes, scores, 10, 2), [3, 4])

    rng = np.random.default_rng(0)
    genes = rng.permutation(40_000)[:9000].astype(np.int64)
    scores = rng.integers(1, 50, genes.shape[0]) / rng.choice([1.0, 1.5, 3.7], genes.shape[0])
    expected = genes[np.lexsort((genes, -scores))][:4096]
    np.testing.assert_array_equal(rank_value_order(genes, scores, 44_000, 4096), expected)
    with pytest.raises(ValueError, match="positive finite"):
        rank_value_order(genes[:2], np.array([1.0, 0.0]), 44_000, 4)


def test_synthetic_cells_are_ranked_top_expressed_genes_within_bounds(smoke_source):
    w = smoke_source.world
    for i in range(200):
        cell = smoke_source.cell(i)
        assert cell.dtype == np.int64
        assert SMOKE.min_genes <= cell.shape[0] <= SMOKE.context_len
        assert np.unique(cell).shape[0] == cell.shape[0], "a gene appears twice in a cell"
        assert cell.min() >= 0 and cell.max() < SMOKE.n_genes
        _, genes, counts = smoke_source.counts(i)
        score = dict(zip(genes.tolist(), (counts / w.typical_G[genes]).tolist(), strict=True))
        s = np.array([score[g] for g in cell.tolist()])
        assert np.all(np.diff(s) <= 0), "cell is not in decreasing normalised expression"
        left_out = set(score) - set(cell.tolist())
        assert cell.shape[0] == min(len(score), SMOKE.context_len)
        assert all(score[g] <= s[-1] for g in left_out), "truncation dropped a higher gene"


def test_lengths_are_jagged_at_a_mid_size_config():
    cfg = proxy().data  # 4096 genes, context 1024, min_genes 128
    source = build_source(cfg, seed=1)
    lengths = np.array([source.cell(i).shape[0] for i in range(300)])
    assert lengths.min() >= cfg.min_genes
    assert lengths.max() == cfg.context_len
    assert 0.05 < np.mean(lengths == cfg.context_len) < 0.6, "share of cells at the cap"
    assert np.quantile(lengths, 0.1) < 0.5 * cfg.context_len, "too few short cells"
    assert np.unique(lengths).shape[0] > 100


# ---- counts ------------------------------------------------------------------------------------


def test_zinb_sampler_matches_moments_and_is_over_dispersed():
    r, d = 2.0, 0.3
    mu = np.repeat([0.05, 0.5, 2.0, 6.0, 40.0], 4000)
    rng = np.random.default_rng(1)
    dense = np.zeros((25, mu.shape[0]))
    for k in range(25):
        genes, counts = sample_zinb_nonzero(rng, mu, r, d)
        assert np.all(counts >= 1)
        dense[k, genes] = counts
    for m in np.unique(mu):
        x = dense[:, mu == m].ravel()
        mean_th = (1 - d) * m
        var_th = (1 - d) * (m + m * m / r) + d * (1 - d) * m * m
        assert abs(x.mean() - mean_th) < 4 * math.sqrt(var_th / x.size) + 1e-3, m
        assert abs(x.var() / var_th - 1) < 0.1, (m, x.var(), var_th)
        assert x.var() > x.mean()


def test_program_genes_are_over_dispersed_across_cells(smoke_source):
    by_type: dict[int, list[np.ndarray]] = {}
    for i in range(600):
        t, genes, counts = smoke_source.counts(i)
        dense = np.zeros(SMOKE.n_genes)
        dense[genes] = counts
        by_type.setdefault(t, []).append(dense)
    t, cells = max(by_type.items(), key=lambda kv: len(kv[1]))
    x = np.stack(cells)[:, np.unique(smoke_source.world.type_genes[t])]
    expressed = x.mean(axis=0) > 1.0
    assert expressed.sum() > 10
    ratio = x.var(axis=0)[expressed] / x.mean(axis=0)[expressed]
    assert np.all(ratio > 1.0), f"variance/mean: {ratio.min():.2f}"


def test_impossible_synthetic_config_raises_data_error():
    cfg = DataConfig(n_genes=40, context_len=64, min_genes=48, genes_per_program=8, n_programs=4)
    with pytest.raises(DataError, match="cannot express"):
        build_source(cfg, seed=0)


# ---- batches -----------------------------------------------------------------------------------


def test_padding_labels_and_bert_masking(smoke_source):
    indices = list(range(100, 164))
    batch = make_batch(
        smoke_source,
        indices,
        context_len=SMOKE.context_len,
        mask_prob=0.15,
        seed=2,
        pad_to_multiple=16,
    )
    B, T = batch.tokens_BT.shape
    lengths = batch.lengths_B.tolist()
    assert B == len(indices) and batch.indices == indices
    assert T % 16 == 0 and T - 16 < max(lengths) <= T
    assert batch.tokens_BT.dtype == batch.labels_BT.dtype == batch.lengths_B.dtype == torch.int64
    assert batch.n_masked == int((batch.labels_BT != IGNORE_LABEL).sum())
    n_mask = n_random = n_kept = 0
    for b, i in enumerate(indices):
        n = lengths[b]
        original = smoke_source.cell(i) + N_SPECIAL_TOKENS
        assert n == original.shape[0]
        tok, lab = batch.tokens_BT[b].numpy(), batch.labels_BT[b].numpy()
        assert np.all(tok[n:] == PAD_ID) and np.all(lab[n:] == IGNORE_LABEL)
        picked = lab[:n] != IGNORE_LABEL
        assert picked.any(), "every cell needs a predicted position"
        np.testing.assert_array_equal(lab[:n][picked], original[picked])
        np.testing.assert_array_equal(tok[:n][~picked], original[~picked])
        x = tok[:n][picked]
        assert np.all((x == MASK_ID) | (x >= N_SPECIAL_TOKENS))
        assert np.all(x < N_SPECIAL_TOKENS + SMOKE.n_genes)
        n_mask += int((x == MASK_ID).sum())
        n_kept += int((x == original[picked]).sum())
        n_random += int(((x != MASK_ID) & (x != original[picked])).sum())
    total = n_mask + n_random + n_kept
    assert abs(total / sum(lengths) - 0.15) < 0.03
    assert abs(n_mask / total - 0.8) < 0.05
    assert 0.05 < n_random / total < 0.15 and 0.05 < n_kept / total < 0.16
    moved = batch.to("cpu")
    assert moved.n_masked == batch.n_masked and torch.equal(moved.tokens_BT, batch.tokens_BT)


def test_one_position_is_always_predicted(smoke_source):
    batch = make_batch(
        smoke_source, range(30), context_len=SMOKE.context_len, mask_prob=1e-6, seed=0
    )
    assert torch.all((batch.labels_BT != IGNORE_LABEL).sum(dim=1) == 1)


def test_make_batch_truncates_to_context_and_rejects_bad_arguments(smoke_source):
    batch = make_batch(smoke_source, range(20), context_len=16, mask_prob=0.15, seed=0)
    assert batch.tokens_BT.shape[1] == 16 and int(batch.lengths_B.max()) == 16
    np.testing.assert_array_equal(
        batch.labels_BT[0][batch.labels_BT[0] != IGNORE_LABEL],
        (smoke_source.cell(0)[:16] + N_SPECIAL_TOKENS)[batch.labels_BT[0].numpy() != -100],
    )
    kw = dict(context_len=SMOKE.context_len, mask_prob=0.15, seed=0)
    with pytest.raises(ValueError, match="divide context_len"):
        make_batch(smoke_source, [0], **{**kw, "pad_to_multiple": 48})
    with pytest.raises(ValueError, match="at least one index"):
        make_batch(smoke_source, [], **kw)
    with pytest.raises(ValueError, match=">= 0"):
        make_batch(smoke_source, [-1], **kw)
    with pytest.raises(ValueError, match="mask_prob"):
        make_batch(smoke_source, [0], **{**kw, "mask_prob": 1.5})
    with pytest.raises(ValueError, match="seed"):
        build_source(SMOKE, seed=-2)


# ---- .h5ad -------------------------------------------------------------------------------------


def _write_h5ad(path, X, names=None):
    anndata = pytest.importorskip("anndata")
    adata = anndata.AnnData(X=X)
    adata.var_names = names or [f"gene{j}" for j in range(X.shape[1])]
    adata.write_h5ad(path)
    return str(path)


def _h5ad_cfg(path, context_len=64) -> DataConfig:
    return DataConfig(source="h5ad", h5ad_path=path, context_len=context_len, min_genes=1)


def _expected_cells(X: np.ndarray, context_len: int) -> dict[int, list[int]]:
    """Geneformer normalisation written out the slow way, per kept row."""
    total = X.sum(axis=1)
    norm = X / np.where(total > 0, total, 1)[:, None] * 1e4
    med = np.array(
        [
            np.median(norm[norm[:, g] > 0, g]) if (norm[:, g] > 0).any() else 1.0
            for g in range(X.shape[1])
        ]
    )
    out = {}
    for row in np.flatnonzero(total > 0):
        genes = np.flatnonzero(X[row] > 0)
        score = norm[row, genes] / med[genes]
        out[row] = genes[np.lexsort((genes, -score))][:context_len].tolist()
    return out


@pytest.mark.parametrize("layout", ["dense", "csr", "csc"])
def test_h5ad_round_trip(tmp_path, layout):
    sp = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(3)
    X = rng.negative_binomial(1.0, 0.6, size=(30, 50)).astype(np.float32)
    X[rng.random(X.shape) < 0.5] = 0
    X[4] = 0
    X[0, :3] = [5, 5, 5]  # ties inside a cell
    stored = {"dense": X, "csr": sp.csr_matrix(X), "csc": sp.csc_matrix(X)}[layout]
    path = _write_h5ad(tmp_path / f"{layout}.h5ad", stored)
    context_len = 8
    with pytest.warns(UserWarning, match="skipped 1 of 30 cells"):
        source = build_source(_h5ad_cfg(path, context_len), seed=5)
    assert source.skipped_cells == 1 and len(source) == 29
    assert source.n_genes == 50 and source.gene_names == [f"gene{j}" for j in range(50)]
    expected = _expected_cells(X, context_len)
    kept_rows = sorted(expected)
    seen = set()
    for i in range(len(source)):
        row = kept_rows[source.row_of(i)]
        seen.add(row)
        assert source.cell(i).tolist() == expected[row], f"row {row}"
    assert seen == set(kept_rows), "one epoch must visit every kept cell once"


def test_h5ad_epochs_reshuffle_and_depend_on_seed(tmp_path):
    X = np.arange(1, 40 * 6 + 1, dtype=np.float32).reshape(40, 6)
    path = _write_h5ad(tmp_path / "e.h5ad", X)
    a = build_source(_h5ad_cfg(path), seed=1)
    b = build_source(_h5ad_cfg(path), seed=2)
    epoch0 = [a.row_of(i) for i in range(40)]
    epoch1 = [a.row_of(i) for i in range(40, 80)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))
    assert epoch0 != epoch1
    assert epoch0 != [b.row_of(i) for i in range(40)]
    assert [a.row_of(i) for i in range(40)] == epoch0, "order must not depend on history"


def test_h5ad_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nope.h5ad"
    with pytest.raises(DataError, match="nope.h5ad"):
        build_source(_h5ad_cfg(str(missing)), seed=0)
    zero = _write_h5ad(tmp_path / "zero.h5ad", np.zeros((5, 4), dtype=np.float32))
    with pytest.raises(DataError, match="all zero"):
        build_source(_h5ad_cfg(zero), seed=0)
    neg = _write_h5ad(tmp_path / "neg.h5ad", -np.ones((3, 4), dtype=np.float32))
    with pytest.raises(DataError, match="negative"):
        build_source(_h5ad_cfg(neg), seed=0)
    empty = _write_h5ad(tmp_path / "empty.h5ad", np.zeros((0, 4), dtype=np.float32))
    with pytest.raises(DataError, match="empty X"):
        build_source(_h5ad_cfg(empty), seed=0)
    ok = _write_h5ad(tmp_path / "ok.h5ad", np.ones((3, 4), dtype=np.float32))
    monkeypatch.setitem(sys.modules, "anndata", None)
    with pytest.raises(ImportError, match=r"stabilitylab\[bio\]"):
        build_source(_h5ad_cfg(ok), seed=0)


def _scaled_with_counts(path, rng) -> tuple[str, np.ndarray]:
    """A file as scanpy leaves it: X scaled (negative values), counts in .raw and layers."""
    anndata = pytest.importorskip("anndata")
    counts = rng.negative_binomial(1.0, 0.5, size=(12, 9)).astype(np.float32)
    counts[:, 0] += 1  # every cell expresses a gene
    adata = anndata.AnnData(X=counts.copy())
    adata.var_names = [f"g{j}" for j in range(9)]
    adata.raw = adata.copy()
    adata.layers["counts"] = counts.copy()
    logged = np.log1p(counts)
    adata.X = (logged - logged.mean(axis=0)) / (logged.std(axis=0) + 1e-6)
    adata.write_h5ad(path)
    return str(path), counts


def test_h5ad_scaled_X_names_the_layer_that_holds_counts(tmp_path):
    path, counts = _scaled_with_counts(tmp_path / "scaled.h5ad", np.random.default_rng(0))
    with pytest.raises(DataError, match=r"X holds negative values.*--data\.h5ad_layer=raw"):
        build_source(_h5ad_cfg(path), seed=0)
    expected = _expected_cells(counts, 64)
    for layer in ("raw", "counts"):
        cfg = dataclasses.replace(_h5ad_cfg(path), h5ad_layer=layer)
        source = build_source(cfg, seed=0)
        assert source.gene_names == [f"g{j}" for j in range(9)]
        assert [source.cell(i).tolist() for i in range(12)] == [
            expected[source.row_of(i)] for i in range(12)
        ]
    with pytest.raises(DataError, match=r"no layer 'spliced'.*\['counts'\]"):
        build_source(dataclasses.replace(_h5ad_cfg(path), h5ad_layer="spliced"), seed=0)


def test_h5ad_layer_is_validated_at_config_time():
    with pytest.raises(ConfigError, match="data.h5ad_layer"):
        DataConfig(h5ad_layer="")


def test_not_an_anndata_file_is_a_data_error(tmp_path):
    bad = tmp_path / "notes.h5ad"
    bad.write_text("not hdf5")
    with pytest.raises(DataError, match=r"notes\.h5ad \(not an AnnData file\?\)"):
        build_source(_h5ad_cfg(str(bad)), seed=0)


def test_fewer_cells_than_a_batch_warn_once_naming_file_and_count(tmp_path):
    one = _write_h5ad(tmp_path / "one.h5ad", np.ones((1, 5), dtype=np.float32))
    with pytest.warns(FewCellsWarning, match=r"one\.h5ad: only 1 usable cell"):
        build_source(_h5ad_cfg(one), seed=0)
    ten = _write_h5ad(tmp_path / "ten.h5ad", np.ones((10, 5), dtype=np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_source(_h5ad_cfg(ten), seed=0, global_batch=16)
        build_source(_h5ad_cfg(ten), seed=0, global_batch=8)
    few = [w for w in caught if issubclass(w.category, FewCellsWarning)]
    assert len(few) == 1 and "only 10 usable cell(s)" in str(few[0].message)
    assert "global batch of 16" in str(few[0].message)


# ---- learnability ------------------------------------------------------------------------------


def test_smoke_model_learns_the_synthetic_cells():
    """The smoke encoder's masked-token loss falls > 1 nat below log(vocab) in 300 AdamW steps.

    Below the unigram entropy too: the model must use the other genes of the cell, not only gene
    frequencies. ~20 s on 2 CPU cores (one torch thread: the test is small, threads only contend).
    """
    cfg = smoke()
    source = build_source(cfg.data, seed=0)
    vocab = vocab_size_for(source.n_genes)
    counts = np.zeros(source.n_genes)
    for i in range(10**9, 10**9 + 500):
        np.add.at(counts, source.cell(i), 1)
    p = counts[counts > 0] / counts.sum()
    unigram_entropy = float(-(p * np.log(p)).sum())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = Transformer(cfg.model, vocab, cfg.data.context_len, "softmax")
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        losses = []
        for step in range(300):
            batch = make_batch(
                source,
                range(step * 16, (step + 1) * 16),
                context_len=cfg.data.context_len,
                mask_prob=cfg.data.mask_prob,
                seed=0,
            )
            loss = masked_lm_loss_sum(model(batch.tokens_BT, batch.lengths_B), batch.labels_BT)
            loss = loss / batch.n_masked
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    start, end = float(np.mean(losses[:5])), float(np.mean(losses[-20:]))
    print(
        f"log V {math.log(vocab):.3f} unigram {unigram_entropy:.3f} start {start:.3f} end {end:.3f}"
    )
    assert abs(start - math.log(vocab)) < 0.2
    assert end < math.log(vocab) - 1.0
    assert end < unigram_entropy - 0.3
