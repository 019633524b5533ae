"""The study's probes on a Transformer: capture, support removal, row sums, gates, tables, figures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch

from stabilitylab.analysis.kv_figures import (
    figure_gate_categories,
    figure_perturbation,
    figure_rowsum_binarization,
)
from stabilitylab.data.text import EOT_ID
from stabilitylab.model import Transformer
from stabilitylab.presets import kv_tiny
from stabilitylab.probes.model_capture import (
    attention_kind,
    capture_attention,
    layer_attention_BHTD,
    swapped_attention,
)
from stabilitylab.probes.model_probes import (
    captured_attention,
    gate_binarization_by_layer,
    gates_by_token_category,
    probe_tables,
    removal_masks_LBT,
    row_sum_cv_by_layer,
    support_removal_by_layer,
)
from stabilitylab.probes.probe_text import (
    full_window_count,
    gpt2_pieces_fn,
    gpt2_to_model_ids,
    probe_window_indices,
    probe_windows,
    spread_indices,
)
from stabilitylab.probes.support_removal import N_SINKS, removal_count
from stabilitylab.probes.token_categories import CATEGORIES, token_category

VOCAB, CONTEXT = 40, 24
LENGTHS = (24, 17, 9)


def tiny_model(seed, backend, gates=True, position="rope", per_head=False) -> Transformer:
    """The kv tiny preset's decoder (2 layers, 2 heads of 32, QK-RMSNorm), random weights large
    enough that the gates spread over (0, 1) rather than sitting at sigmoid(5)."""
    cfg = dataclasses.replace(
        kv_tiny().model, gates=gates, position=position, gate_per_head=per_head
    )
    torch.manual_seed(seed)
    model = Transformer(cfg, VOCAB, CONTEXT, backend)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "gate" not in name:
                p.normal_(0.0, 0.3)
        for block in model.blocks:
            if block.gate_out is not None:
                block.gate_out.weight_GC.normal_(0.0, 0.3)
                block.gate_out.bias_G.fill_(0.0)
    return model.eval()


def windows(seed, lengths=LENGTHS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    tokens_BT = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=g)
    return tokens_BT, torch.tensor(lengths)


MODELS = [
    ("softmax", True, "rope", False),
    ("softmax-reference", True, "none", False),
    ("sigmoid-reference", True, "rope", False),
    ("sigmoid-reference", False, "none", False),
    ("softmax-reference", True, "rope", True),
    ("sigmoid-reference", True, "none", True),
]


# ---- capture ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend,gates,position,per_head", MODELS)
def test_capture_matches_the_backend_and_changes_nothing(seed, backend, gates, position, per_head):
    model = tiny_model(seed, backend, gates, position, per_head)
    tokens_BT, lengths_B = windows(seed)
    with torch.no_grad():
        plain = model(tokens_BT, lengths_B)
    logits, records = captured_attention(model, tokens_BT, lengths_B)
    assert torch.equal(logits, plain)
    assert [r.layer for r in records] == [0, 1]
    for r in records:
        assert r.kind == attention_kind(backend) and r.causal
        assert (r.key_bias_BHT is not None) == (gates and r.layer > 0)
        torch.testing.assert_close(layer_attention_BHTD(r), r.out_BHTD, rtol=1e-4, atol=1e-5)


def test_the_backends_come_back_even_when_the_block_raises(seed):
    model = tiny_model(seed, "sigmoid-reference")
    originals = [a.backend for a in model.attention_layers]
    for manager in (capture_attention(model), swapped_attention(model, layer_attention_BHTD)):
        with pytest.raises(RuntimeError, match="inside"), manager:
            assert all(
                a.backend is not o for a, o in zip(model.attention_layers, originals, strict=True)
            )
            raise RuntimeError("inside the block")
        assert all(a.backend is o for a, o in zip(model.attention_layers, originals, strict=True))


def test_an_unknown_backend_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="'tanh-attention'"):
        attention_kind("tanh-attention")
    assert attention_kind("sigmoid-triton-exact") == "sigmoid"
    assert attention_kind("softmax-flex") == "softmax"


# ---- support removal --------------------------------------------------------------------------


def test_removal_masks_keep_sinks_and_padding_and_nest_across_p(seed):
    lengths_B = torch.tensor(LENGTHS)
    T = max(LENGTHS)
    small = removal_masks_LBT(lengths_B, T, 0.3, 3, seed)
    large = removal_masks_LBT(lengths_B, T, 0.6, 3, seed)
    for masks, p in ((small, 0.3), (large, 0.6)):
        assert masks.shape == (3, len(LENGTHS), T)
        assert not masks[:, :, :N_SINKS].any()
        for b, n in enumerate(LENGTHS):
            assert not masks[:, b, n:].any()
            assert (masks[:, b].sum(dim=-1) == removal_count(n - N_SINKS, p)).all()
    assert (large | ~small).all()  # the p = 0.3 removal is a subset of the p = 0.6 one
    assert not torch.equal(small[0], small[1])  # a fresh mask per layer


@pytest.mark.parametrize("backend,gates,position,per_head", MODELS[1:4])
def test_no_removal_gives_zero_perturbation_in_both_protocols(
    seed, backend, gates, position, per_head
):
    model = tiny_model(seed, backend, gates, position, per_head)
    tokens_BT, lengths_B = windows(seed)
    table = support_removal_by_layer(
        model, tokens_BT, lengths_B, ps=(0.0, 0.5), seed=seed, protocol=("isolated", "compound")
    )
    assert list(table.columns) == ["layer", "p", "perturbation", "std", "n_sequences", "protocol"]
    assert len(table) == 2 * 2 * 2 and (table["n_sequences"] == len(LENGTHS)).all()
    assert (table[table["p"] == 0.0]["perturbation"] == 0.0).all()
    assert (table[table["p"] == 0.5]["perturbation"] > 0.0).all()


@pytest.mark.parametrize("backend", ["softmax-reference", "sigmoid-reference"])
def test_compound_equals_isolated_at_layer_0_and_not_after(seed, backend):
    model = tiny_model(seed, backend)
    tokens_BT, lengths_B = windows(seed)
    args = dict(ps=(0.3, 0.5), seed=seed)
    iso = support_removal_by_layer(model, tokens_BT, lengths_B, protocol="isolated", **args)
    comp = support_removal_by_layer(model, tokens_BT, lengths_B, protocol="compound", **args)
    at0 = [t[t["layer"] == 0].set_index("p")["perturbation"] for t in (iso, comp)]
    pd.testing.assert_series_equal(at0[0], at0[1], rtol=1e-6)
    at1 = [t[t["layer"] == 1].set_index("p")["perturbation"] for t in (iso, comp)]
    assert not np.allclose(at1[0], at1[1])  # upstream removal reaches layer 1's q, k, v


def test_chunks_do_not_change_the_tables(seed):
    model = tiny_model(seed, "sigmoid-reference")
    tokens_BT, lengths_B = windows(seed)
    whole = support_removal_by_layer(model, tokens_BT, lengths_B, ps=(0.5,), seed=seed)
    chunked = support_removal_by_layer(
        model, tokens_BT, lengths_B, ps=(0.5,), seed=seed, batch_size=2
    )
    pd.testing.assert_frame_equal(whole, chunked, rtol=1e-5)
    pd.testing.assert_frame_equal(
        gate_binarization_by_layer(model, tokens_BT, lengths_B),
        gate_binarization_by_layer(model, tokens_BT, lengths_B, batch_size=1),
    )


# ---- row sums and gates -----------------------------------------------------------------------


@pytest.mark.parametrize("gates", [False, True])
def test_row_sum_cv_is_zero_for_softmax_and_positive_for_sigmoid(seed, gates):
    tokens_BT, lengths_B = windows(seed)
    soft = row_sum_cv_by_layer(tiny_model(seed, "softmax", gates), tokens_BT, lengths_B)
    sig = row_sum_cv_by_layer(tiny_model(seed, "sigmoid-reference", gates), tokens_BT, lengths_B)
    assert list(soft["layer"]) == [0, 1] and (soft["n"] == len(LENGTHS) * 2).all()
    for stat in ("row_sum_cv_norm", "row_sum_cv_raw"):
        assert (soft[stat].abs() < 1e-12).all(), stat
        assert (sig[stat] > 0.01).all(), stat


def test_row_sum_cvs_of_a_model_that_attends_uniformly():
    """q = 0 in every layer (the q third of qkv zeroed; QK-RMSNorm keeps 0 at 0): every logit is
    0, the model's causal rows under b = -log L sum to (i + 1) / (L + 1). The raw CV is the
    row-length confound sqrt((L - 1) / (3 (L + 1))), averaged over the windows; normalised, 0."""
    model = tiny_model(1, "sigmoid-reference", gates=False)
    with torch.no_grad():
        for attn in model.attention_layers:
            C = attn.qkv.in_features
            attn.qkv.weight[:C].zero_()
            attn.qkv.bias[:C].zero_()
    tokens_BT, lengths_B = windows(1)
    table = row_sum_cv_by_layer(model, tokens_BT, lengths_B)
    raw = np.mean([np.sqrt((L - 1) / (3 * (L + 1))) for L in LENGTHS])
    assert table["row_sum_cv_raw"].tolist() == pytest.approx([raw, raw], rel=1e-9)
    assert (table["row_sum_cv_norm"].abs() < 1e-12).all()


def test_the_row_sum_summary_keeps_nan(seed, monkeypatch):
    """A layer whose rows all have zero mass has CV 0/0 = NaN: the mean over layers keeps it."""
    import stabilitylab.probes.model_probes as mp

    model = tiny_model(seed, "sigmoid-reference", gates=False)
    tokens_BT, lengths_B = windows(seed)
    table = row_sum_cv_by_layer(model, tokens_BT, lengths_B)
    table.loc[1, "row_sum_cv_norm"] = np.nan
    monkeypatch.setattr(mp, "row_sum_cv_by_layer", lambda *args: table)
    summary = mp.rowsum_binarization_tables({"sig": model}, tokens_BT, lengths_B)
    row = summary["rowsum_binarization_summary"].iloc[0]
    assert np.isnan(row["row_sum_cv_norm"])
    assert row["row_sum_cv_raw"] == pytest.approx(table["row_sum_cv_raw"].mean())


@pytest.mark.parametrize("per_head", [False, True])
def test_binarization_matches_a_hand_count(seed, per_head):
    model = tiny_model(seed, "sigmoid-reference", per_head=per_head)
    tokens_BT, lengths_B = windows(seed)
    table = gate_binarization_by_layer(model, tokens_BT, lengths_B)
    with torch.no_grad():
        model(tokens_BT, lengths_B)
    g = model.gates[0]
    g_BHT = g if g.dim() == 3 else g[:, None, :]
    values = torch.cat([g_BHT[b, :, :n].flatten() for b, n in enumerate(LENGTHS)]).double()
    low, high = int((values < 0.05).sum()), int((values > 0.95).sum())
    assert low + high > 0  # the weights spread the gates: the count is not trivial
    row = table.iloc[0]
    assert len(table) == 1 and row["layer"] == 0 and row["count"] == values.numel()
    assert row["frac_below_0.05"] == pytest.approx(low / values.numel())
    assert row["frac_above_0.95"] == pytest.approx(high / values.numel())
    assert row["binarization"] == pytest.approx((low + high) / values.numel())
    assert row["gate_mean"] == pytest.approx(float(values.mean()))


def test_gate_probes_refuse_a_dense_model(seed):
    tokens_BT, lengths_B = windows(seed)
    with pytest.raises(ValueError, match="no gates"):
        gate_binarization_by_layer(tiny_model(seed, "softmax", gates=False), tokens_BT, lengths_B)


PIECES = [" the", " cat", ",", "\n", "  ", " 1999", " of", "ing", ".", " Paris"]


def hand_pieces(ids):
    """Model id i reads PIECES[i % 10]; id 0 stands for end-of-text (None: left out)."""
    return [None if i == 0 else PIECES[i % len(PIECES)] for i in ids]


def test_category_table_on_hand_made_pieces(seed):
    model = tiny_model(seed, "sigmoid-reference")
    tokens_BT, lengths_B = windows(seed)
    tokens_BT[0, 3] = 0  # one end-of-text inside a window
    table = gates_by_token_category(model, tokens_BT, lengths_B, hand_pieces)
    with torch.no_grad():
        model(tokens_BT, lengths_B)
    g_BT = model.gates[0]  # one gate layer: the mean over layers is this layer
    by_category = {c: [] for c in CATEGORIES}
    for b, n in enumerate(LENGTHS):
        for t in range(n):
            i = int(tokens_BT[b, t])
            if i:
                by_category[token_category(PIECES[i % len(PIECES)])].append(float(g_BT[b, t]))
    assert list(table["category"]) == list(CATEGORIES)
    for row in table.itertuples():
        expected = by_category[row.category]
        assert row.count == len(expected)
        if expected:
            assert row.mean_gate == pytest.approx(np.mean(expected), rel=1e-6)
    n_eot = sum(int((tokens_BT[b, :n] == 0).sum()) for b, n in enumerate(LENGTHS))
    assert n_eot >= 1 and table["count"].sum() == sum(LENGTHS) - n_eot


# ---- pieces -----------------------------------------------------------------------------------


class FakeEncoding:
    def decode_single_token_bytes(self, gpt2_id: int) -> bytes:
        return {EOT_ID: b"<|endoftext|>", 11: b",", 262: b" the", 13: b".", 8: b"\xe2"}[gpt2_id]


def test_pieces_map_a_compact_vocabulary_back_to_gpt2_ids():
    vocab = {"model_id_to_gpt2_id": [8, 11, 13, 262, EOT_ID]}
    pieces = gpt2_pieces_fn(vocab, FakeEncoding())
    assert pieces([3, 1, 2, 4, 0]) == [" the", ",", ".", None, "\ufffd"]
    gpt2 = gpt2_pieces_fn(None, FakeEncoding())
    assert gpt2([262, EOT_ID]) == [" the", None]
    tokens = torch.tensor([[262, 11, EOT_ID]])
    assert gpt2_to_model_ids(tokens, vocab).tolist() == [[3, 1, 4]]
    with pytest.raises(ValueError, match=r"\[995\]"):
        gpt2_to_model_ids(torch.tensor([[262, 995]]), vocab)


# ---- which windows ----------------------------------------------------------------------------


@pytest.mark.parametrize("N, n", [(1000, 50), (203, 50), (51, 50), (8, 4)])
def test_probe_windows_are_spread_across_the_split(seed, N, n):
    picks = spread_indices(N, n, seed % 1000)
    assert len(picks) == n and len(set(picks)) == n and picks == sorted(picks)
    assert 0 <= picks[0] < N / 4 and 3 * N / 4 <= picks[-1] < N  # first and last quarter
    for k, i in enumerate(picks):  # one pick in each of the n strata of N / n windows
        assert k * N // n <= i < (k + 1) * N / n
    assert spread_indices(N, n, seed % 1000) == picks  # deterministic for a seed
    offsets = {tuple(spread_indices(N, n, s)) for s in range(20)}
    assert len(offsets) > 1  # the seed moves the offset


def test_probe_windows_clamp_to_the_split_and_refuse_bad_counts():
    assert spread_indices(30, 50, 3) == list(range(30))
    assert spread_indices(30, 30, 3) == list(range(30))
    assert spread_indices(30, None, 3) == list(range(30))
    for bad in ({"n_available": 0, "n": 1}, {"n_available": 5, "n": 0}):
        with pytest.raises(ValueError, match="must be >= 1"):
            spread_indices(**bad, seed=0)


def test_only_full_windows_are_drawn():
    from stabilitylab.data.text import EvalWindows

    ragged = EvalWindows(np.arange(1000), 8)  # 124 windows of 9 tokens, then one of 8
    assert len(ragged) == 125 and full_window_count(ragged) == 124
    assert probe_window_indices(ragged, None) == list(range(124))
    assert max(probe_window_indices(ragged, 50, seed=7)) < 124
    assert full_window_count(EvalWindows(np.arange(81), 8)) == 10  # the last one is full
    assert full_window_count(EvalWindows(np.arange(5), 8)) == 1  # one short window: kept


def test_probe_windows_read_the_drawn_windows_of_the_sample():
    from stabilitylab.data.text import EvalWindows, open_sample

    data = kv_tiny().data  # the shipped sample's test split: 3 full windows of 64, one short
    test = EvalWindows(open_sample().split("test"), data.context_len)
    tokens_BT, lengths_B = probe_windows(data, None, "test", 2, seed=1)
    picks = probe_window_indices(test, 2, seed=1)
    assert lengths_B.tolist() == [64, 64]
    for row, k in zip(tokens_BT, picks, strict=True):
        assert row.tolist() == test.sample(k)[:-1].tolist()
    every_BT, every_B = probe_windows(data, None, "test", None)
    assert every_B.tolist() == [64, 64, 64]


# ---- the study's tables and figures -----------------------------------------------------------


def test_probe_tables_and_figures(seed, tmp_path):
    models = {
        "sm-rope": tiny_model(seed, "softmax-reference", gates=False),
        "sig-g-nope": tiny_model(seed, "sigmoid-reference", position="none"),
    }
    tokens_BT, lengths_B = windows(seed)
    tables = probe_tables(models, tokens_BT, lengths_B, hand_pieces, extreme_min_count=1)
    assert set(tables) == {
        "support_removal", "support_removal_summary", "rowsum_binarization",
        "rowsum_binarization_summary", "table4_categories", "extreme_tokens",
    }  # fmt: skip
    for name, table in tables.items():
        assert table.columns[0] == "cell", name
    for name in ("table4_categories", "extreme_tokens"):
        assert set(tables[name]["cell"]) == {"sig-g-nope"}, name
    summary = tables["support_removal_summary"]
    assert len(summary) == 2 * 2 * 3 and (summary["n_layers"] == 2).all()
    rows = tables["rowsum_binarization"].set_index(["cell", "layer"])
    assert rows["binarization"].isna().tolist() == [True, True, False, True]
    assert rows.loc[("sm-rope", 0), "kind"] == "softmax"
    for figure, table, name in (
        (figure_perturbation, "support_removal", "fig2.png"),
        (figure_rowsum_binarization, "rowsum_binarization", "fig3.png"),
        (figure_gate_categories, "table4_categories", "table4.png"),
    ):
        path = figure(tables[table], tmp_path / name)
        assert path == tmp_path / name and path.stat().st_size > 0


def test_bad_requests_are_refused_before_work(seed):
    model = tiny_model(seed, "sigmoid-reference")
    tokens_BT, lengths_B = windows(seed)
    with pytest.raises(ValueError, match="protocol"):
        support_removal_by_layer(model, tokens_BT, lengths_B, protocol="everywhere")
    with pytest.raises(ValueError, match="1.5"):
        support_removal_by_layer(model, tokens_BT, lengths_B, ps=(1.5,))
    with pytest.raises(ValueError, match="vocabulary"):
        row_sum_cv_by_layer(model, tokens_BT + VOCAB, lengths_B)
    with pytest.raises(ValueError, match="cell 'x'"):
        probe_tables({"x": model}, tokens_BT, torch.tensor([24, 30, 9]), hand_pieces)
    with pytest.raises(ValueError, match="figure_perturbation.*perturbation"):
        figure_perturbation(pd.DataFrame({"cell": ["x"]}), "/unused.png")


def test_cells_must_share_one_vocabulary():
    from stabilitylab.eviction.cells import StudyError
    from stabilitylab.probes.probe_text import shared_vocab

    compact = {"tokenizer": "r50k_base", "model_id_to_gpt2_id": [0, 5, 9]}
    assert shared_vocab({"sm-rope": compact, "sig-rope": dict(compact)}, "run") == compact
    other = {**compact, "model_id_to_gpt2_id": [0, 5, 7]}
    with pytest.raises(StudyError, match=r"study: cells \['sig-rope'\] have another vocab.json"):
        shared_vocab({"sm-rope": compact, "sig-rope": other}, "study", StudyError)
    with pytest.raises(ValueError, match="no cells"):
        shared_vocab({}, "run")
