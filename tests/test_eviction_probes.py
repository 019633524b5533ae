"""The eviction study's probes: masked attention, support removal, row-sum CV, gates, categories."""

from __future__ import annotations

import math
import os

import numpy as np
import pandas as pd
import pytest
import torch

from stabilitylab.probes.gates import (
    GateSums,
    gate_stats,
    gate_stats_LBT,
    gate_stats_table,
    gate_sums,
    pooled_gate_stats,
)
from stabilitylab.probes.masked_attention import attention_weights_BHTT, masked_attention_BHTD
from stabilitylab.probes.rowsum import (
    row_mass_BT,
    row_sum_cv_BH,
    row_sum_cv_table,
    row_sum_cvs_BH,
    row_sum_cvs_from_qk_BH,
)
from stabilitylab.probes.support_removal import (
    layer_average_by_p,
    mean_over_sequences,
    relative_perturbation_B,
    removal_count,
    sample_removal_mask_BT,
    support_removal_perturbation_B,
    support_removal_table,
)
from stabilitylab.probes.token_categories import (
    CATEGORIES,
    extreme_tokens,
    gate_by_category,
    token_category,
)

F64 = torch.float64


@pytest.fixture
def gen() -> torch.Generator:
    """Fresh inputs every run from an OS seed, printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


def random_inputs(gen, B=3, H=2, T=13, D=8, lengths=(13, 9, 6)):
    q, k, v = (torch.randn(B, H, T, D, generator=gen, dtype=F64) for _ in range(3))
    key_bias_BT = torch.log(torch.rand(B, T, generator=gen, dtype=F64) + 1e-8)
    return q, k, v, torch.tensor(lengths), key_bias_BT


def loop_attention(q, k, v, lengths, kind, causal, key_bias, removed, sigmoid_bias=None):
    """Brute force, one (b, h, i) at a time, with Python scalars: weights and output."""
    B, H, T, D = q.shape
    a = torch.zeros(B, H, T, T, dtype=F64)
    for b in range(B):
        L = int(lengths[b])
        bias = -math.log(L) if sigmoid_bias is None else sigmoid_bias
        for h in range(H):
            for i in range(L):
                js = [
                    j
                    for j in range(L)
                    if (removed is None or not removed[b, j]) and (not causal or j <= i)
                ]
                z = {j: float(q[b, h, i] @ k[b, h, j]) / math.sqrt(D) for j in js}
                if key_bias is not None:
                    z = {j: z[j] + float(key_bias[b, j]) for j in js}
                if kind == "softmax" and js:
                    top = max(z.values())
                    total = sum(math.exp(z[j] - top) for j in js)
                    for j in js:
                        a[b, h, i, j] = math.exp(z[j] - top) / total
                elif kind == "sigmoid":
                    for j in js:
                        a[b, h, i, j] = 1.0 / (1.0 + math.exp(-(z[j] + bias)))
    v_kept = v if removed is None else v * (~removed)[:, None, :, None]
    return a, a @ v_kept


# ---- masked attention --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_masked_attention_matches_loop(gen, kind, causal, with_bias):
    q, k, v, lengths, key_bias = random_inputs(gen)
    key_bias = key_bias if with_bias else None
    removed = torch.rand(3, 13, generator=gen) < 0.3
    for rem in (None, removed):
        a_ref, o_ref = loop_attention(q, k, v, lengths, kind, causal, key_bias, rem)
        kw = dict(kind=kind, causal=causal, key_bias_BT=key_bias, removed_BT=rem)
        a = attention_weights_BHTT(q, k, lengths, **kw)
        o = masked_attention_BHTD(q, k, v, lengths, **kw)
        torch.testing.assert_close(a, a_ref, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-13)


def test_masked_attention_given_sigmoid_bias_and_empty_rows(gen):
    q, k, v, lengths, _ = random_inputs(gen)
    a_ref, o_ref = loop_attention(q, k, v, lengths, "sigmoid", False, None, None, sigmoid_bias=-2.5)
    o = masked_attention_BHTD(q, k, v, lengths, kind="sigmoid", sigmoid_bias=-2.5)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-13)
    # Every key removed: softmax rows are empty, and give zeros rather than NaN.
    everything = torch.ones(3, 13, dtype=torch.bool)
    o_empty = masked_attention_BHTD(q, k, v, lengths, kind="softmax", removed_BT=everything)
    assert torch.equal(o_empty, torch.zeros_like(o_empty))


def test_masked_attention_rejects_bad_input(gen):
    q, k, v, lengths, _ = random_inputs(gen)
    with pytest.raises(ValueError, match="unknown attention kind 'relu'"):
        masked_attention_BHTD(q, k, v, lengths, kind="relu")
    with pytest.raises(ValueError, match="key_bias_BT shape"):
        masked_attention_BHTD(q, k, v, lengths, kind="sigmoid", key_bias_BT=torch.zeros(3, 12))
    with pytest.raises(ValueError, match="lengths_B shape"):
        masked_attention_BHTD(q, k, v, lengths[:2], kind="softmax")


# ---- support removal ---------------------------------------------------------------------


def test_removal_count_rounds_half_up():
    assert [removal_count(n, 0.5) for n in (0, 1, 3, 5)] == [0, 1, 2, 3]
    assert removal_count(10, 0.3) == 3 and removal_count(9, 0.1) == 1 and removal_count(4, 0.1) == 0
    assert removal_count(7, 1.0) == 7 and removal_count(7, 0.0) == 0
    with pytest.raises(ValueError, match="removal fraction p must be in"):
        removal_count(10, 1.5)


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.9])
def test_removal_mask_spares_sinks_and_padding(gen, p):
    lengths = torch.randint(1, 60, (16,), generator=gen)
    lengths[:4] = torch.tensor([1, 4, 5, 60])
    removed = sample_removal_mask_BT(lengths, 60, p, gen)
    assert removed.shape == (16, 60) and removed.dtype == torch.bool
    assert not removed[:, :4].any()
    padding = torch.arange(60)[None, :] >= lengths[:, None]
    assert not (removed & padding).any()
    for b, n in enumerate(lengths.tolist()):
        eligible = max(0, n - 4)
        assert int(removed[b].sum()) == math.floor(p * eligible + 0.5)


def test_removal_mask_is_reproducible_and_varies(gen):
    lengths = torch.full((4,), 200)
    state = gen.get_state()
    first = sample_removal_mask_BT(lengths, 200, 0.3, gen)
    gen.set_state(state)
    assert torch.equal(sample_removal_mask_BT(lengths, 200, 0.3, gen), first)
    assert not all(torch.equal(first[0], first[b]) for b in range(1, 4))  # one mask per sequence


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("causal", [False, True])
def test_removal_at_p0_gives_zero(gen, kind, causal):
    q, k, v, lengths, key_bias = random_inputs(gen)
    delta, removed = support_removal_perturbation_B(
        q, k, v, lengths, kind=kind, p=0.0, generator=gen, causal=causal, key_bias_BT=key_bias
    )
    assert not removed.any()
    assert torch.equal(delta, torch.zeros(3, dtype=F64))


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
@pytest.mark.parametrize("causal", [False, True])
def test_removal_perturbation_matches_brute_force(gen, kind, causal):
    q, k, v, lengths, key_bias = random_inputs(gen, T=20, lengths=(20, 15, 11))
    state = gen.get_state()
    delta, removed = support_removal_perturbation_B(
        q, k, v, lengths, kind=kind, p=0.5, generator=gen, causal=causal, key_bias_BT=key_bias
    )
    gen.set_state(state)
    assert torch.equal(removed, sample_removal_mask_BT(lengths, 20, 0.5, gen))
    _, o = loop_attention(q, k, v, lengths, kind, causal, key_bias, None)
    _, o_t = loop_attention(q, k, v, lengths, kind, causal, key_bias, removed)
    expected = torch.tensor(
        [float((o_t[b] - o[b]).norm() / o[b].norm()) for b in range(3)], dtype=F64
    )
    torch.testing.assert_close(delta, expected, rtol=1e-10, atol=0)
    assert (delta > 0).all()


def test_sigmoid_row_loses_exactly_the_removed_terms(gen):
    """Without renormalisation, o~_i = o_i - sum_{j removed} a_ij v_j under sigmoid."""
    q, k, v, lengths, _ = random_inputs(gen)
    removed = sample_removal_mask_BT(lengths, 13, 0.4, gen)
    a = attention_weights_BHTT(q, k, lengths, kind="sigmoid")
    o = masked_attention_BHTD(q, k, v, lengths, kind="sigmoid")
    o_t = masked_attention_BHTD(q, k, v, lengths, kind="sigmoid", removed_BT=removed)
    lost = (a * removed[:, None, None, :]) @ v
    torch.testing.assert_close(o_t, o - lost, rtol=1e-12, atol=1e-13)


def test_relative_perturbation_ignores_padding_rows():
    out = torch.zeros(2, 1, 4, 2, dtype=F64)
    out[0, 0, 0] = torch.tensor([3.0, 4.0])  # norm 5
    out[1, 0, :2] = 1.0  # norm 2
    tilde = out.clone()
    tilde[0, 0, 1] = torch.tensor([0.0, 1.0])  # diff 1 on a valid row
    tilde[1, 0, 3] = 100.0  # on a padding row of sequence 1: ignored
    delta = relative_perturbation_B(out, tilde, torch.tensor([4, 2]))
    torch.testing.assert_close(delta, torch.tensor([0.2, 0.0], dtype=F64))


def test_support_removal_tables():
    deltas = {
        (0, 0.1): [torch.tensor([0.1, 0.3]), torch.tensor([0.2])],
        (1, 0.1): torch.tensor([0.4, 0.4, 0.4]),
        (0, 0.5): torch.tensor([1.0, 3.0]),
        (1, 0.5): torch.tensor([2.0]),
    }
    table = support_removal_table(deltas)
    assert list(table.columns) == ["layer", "p", "perturbation", "std", "n_sequences"]
    row = table[(table.layer == 0) & (table.p == 0.1)].iloc[0]
    assert row.perturbation == pytest.approx(0.2) and row.n_sequences == 3
    assert row["std"] == pytest.approx(np.std([0.1, 0.3, 0.2]))
    summary = layer_average_by_p(table).set_index("p")
    assert summary.loc[0.1, "perturbation"] == pytest.approx(0.3)
    assert summary.loc[0.5, "perturbation"] == pytest.approx(2.0)
    assert summary.loc[0.5, "n_layers"] == 2
    assert mean_over_sequences([torch.tensor([1.0]), torch.tensor([2.0, 6.0])]) == pytest.approx(3)


# ---- row-sum CV --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_row_sum_cv_softmax_is_zero_sigmoid_is_not(gen, causal, with_bias):
    q, k, _, lengths, key_bias = random_inputs(gen, B=4, T=32, lengths=(32, 17, 9, 2))
    key_bias = key_bias if with_bias else None
    kw = dict(causal=causal, key_bias_BT=key_bias)
    soft = row_sum_cvs_from_qk_BH(q, k, lengths, kind="softmax", **kw)
    sig = row_sum_cvs_from_qk_BH(q, k, lengths, kind="sigmoid", **kw)
    assert list(soft) == list(sig) == ["norm", "raw"]
    for stat in ("norm", "raw"):
        assert soft[stat].shape == sig[stat].shape == (4, 2)
        assert soft[stat].abs().max() < 1e-12, stat
        # Any one (sequence, head) could come out near 0 by chance; their mean cannot.
        assert (sig[stat] > 0).all() and sig[stat].mean() > 0.01, stat
    if not causal:  # every valid row sees all L keys: dividing by L changes no CV
        torch.testing.assert_close(sig["norm"], sig["raw"])


def test_uniform_sigmoid_attention_under_b_minus_log_L():
    """Equal logits (q = 0), b = -log L: a_ij = 1 / (L + 1), so r_i = (i + 1) / (L + 1). The raw
    CV is that of 1 .. L: sqrt((L^2 - 1) / 12) / ((L + 1) / 2) = sqrt((L - 1) / (3 (L + 1)));
    the row-length confound alone. The mean weight per visible key is the same on every row."""
    lengths = torch.tensor([512, 100])
    q = torch.zeros(2, 1, 512, 4, dtype=F64)
    cvs = row_sum_cvs_from_qk_BH(q, torch.ones_like(q), lengths, kind="sigmoid", causal=True)
    expected = [math.sqrt(511 / (3 * 513)), math.sqrt(99 / (3 * 101))]
    assert expected[0] == pytest.approx(0.57622, abs=1e-5)
    torch.testing.assert_close(cvs["raw"][:, 0], torch.tensor(expected, dtype=F64))
    assert cvs["norm"].abs().max() < 1e-12


def causal_hand_weights() -> torch.Tensor:
    """Two sequences, causal weights (T = 4): lengths 4 and 2; 50.0 marks padding."""
    a = torch.zeros(2, 1, 4, 4, dtype=F64)
    a[0, 0, 0, :1] = torch.tensor([0.5])  # r = 0.5, per key 0.5
    a[0, 0, 1, :2] = torch.tensor([0.2, 0.6])  # r = 0.8, per key 0.4
    a[0, 0, 2, :3] = torch.tensor([0.3, 0.3, 0.3])  # r = 0.9, per key 0.3
    a[0, 0, 3, :4] = torch.tensor([0.1, 0.1, 0.1, 0.5])  # r = 0.8, per key 0.2
    a[1, 0, 0, :1] = torch.tensor([0.2])  # r = 0.2, per key 0.2
    a[1, 0, 1, :2] = torch.tensor([0.3, 0.3])  # r = 0.6, per key 0.3
    a[1, 0, 2, :3] = 50.0  # a padded row: left out
    return a


def test_row_sum_cvs_match_hand_computation():
    cvs = row_sum_cvs_BH(causal_hand_weights(), torch.tensor([4, 2]), kind="sigmoid", causal=True)
    # raw: sums 0.5 0.8 0.9 0.8 (mean 0.75, deviations -.25 .05 .15 .05: var 0.0225) -> 0.2;
    #      sums 0.2 0.6 (mean 0.4, std 0.2) -> 0.5.
    # norm: per key 0.5 0.4 0.3 0.2 (mean 0.35, var 0.0125) -> sqrt(0.0125) / 0.35;
    #       per key 0.2 0.3 (mean 0.25, std 0.05) -> 0.2.
    torch.testing.assert_close(cvs["raw"][:, 0], torch.tensor([0.2, 0.5], dtype=F64))
    norm = [math.sqrt(0.0125) / 0.35, 0.2]
    torch.testing.assert_close(cvs["norm"][:, 0], torch.tensor(norm, dtype=F64))
    assert norm[0] == pytest.approx(0.319438, abs=1e-6)
    # Softmax's row mass does not depend on the row's length: its divisor is 1, norm = raw.
    soft = row_sum_cvs_BH(causal_hand_weights(), torch.tensor([4, 2]), kind="softmax", causal=True)
    torch.testing.assert_close(soft["norm"], soft["raw"])
    torch.testing.assert_close(soft["raw"], cvs["raw"])


def test_row_mass_counts_the_visible_keys():
    lengths = torch.tensor([3, 1])
    causal = row_mass_BT(lengths, 4, kind="sigmoid", causal=True)
    assert causal.tolist() == [[1, 2, 3, 1], [1, 1, 1, 1]]  # padded rows: 1
    assert row_mass_BT(lengths, 4, kind="sigmoid", causal=False).tolist() == [
        [3, 3, 3, 1], [1, 1, 1, 1]
    ]  # fmt: skip
    assert (row_mass_BT(lengths, 4, kind="softmax", causal=True) == 1).all()
    with pytest.raises(ValueError, match="'tanh'"):
        row_mass_BT(lengths, 4, kind="tanh", causal=True)


def test_row_sum_cv_matches_hand_computation():
    a = torch.zeros(2, 1, 4, 4, dtype=F64)
    a[0, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0, 6.0])  # row sums 1, 2, 3, 6
    a[1, 0, 0, 0], a[1, 0, 1, 1] = 2.0, 4.0  # valid rows 0, 1: sums 2, 4; row 2 is padding
    a[1, 0, 2, 2] = 50.0
    cv = row_sum_cv_BH(a, torch.tensor([4, 2]))
    expected = [np.std([1, 2, 3, 6]) / 3.0, np.std([2, 4]) / 3.0]
    torch.testing.assert_close(cv[:, 0], torch.tensor(expected, dtype=F64))


def test_row_sum_cv_table():
    table = row_sum_cv_table(
        {
            "raw": {1: torch.tensor([[0.2, 0.4]]), 0: [torch.zeros(2, 2)]},
            "norm": {1: torch.tensor([[0.1, float("nan")]]), 0: [torch.ones(2, 2)]},
        }
    )
    assert list(table.columns) == [
        "layer", "row_sum_cv_norm", "row_sum_cv_norm_std", "row_sum_cv_raw", "row_sum_cv_raw_std",
        "n",
    ]  # fmt: skip
    assert table.layer.tolist() == [0, 1]
    assert table.row_sum_cv_raw.tolist() == pytest.approx([0.0, 0.3])
    assert table.row_sum_cv_raw_std.tolist() == pytest.approx([0.0, 0.1])
    assert table.row_sum_cv_norm[0] == 1.0 and np.isnan(table.row_sum_cv_norm[1])  # NaN kept
    assert table.n.tolist() == [4, 2]
    with pytest.raises(ValueError, match="different"):
        row_sum_cv_table({"raw": {0: torch.zeros(2)}, "norm": {0: torch.zeros(3)}})


# ---- gates -------------------------------------------------------------------------------


def hand_gates():
    """Two layers, two sequences of lengths 3 and 2 (T = 4); 9.0 marks padding."""
    g = torch.tensor(
        [
            [[0.01, 0.5, 0.97, 9.0], [0.05, 0.96, 9.0, 9.0]],
            [[0.2, 0.3, 0.4, 9.0], [0.95, 0.001, 9.0, 9.0]],
        ]
    )
    return g, torch.tensor([3, 2])


def test_gate_stats_by_hand():
    g, lengths = hand_gates()
    stats = gate_stats_LBT(g, lengths)
    # Layer 0: valid 0.01 0.5 0.97 0.05 0.96 -> low {0.01}, high {0.97, 0.96}; 0.05 is not < 0.05.
    # Layer 1: valid 0.2 0.3 0.4 0.95 0.001 -> low {0.001}; 0.95 is not > 0.95.
    torch.testing.assert_close(stats["frac_low_L"], torch.tensor([0.2, 0.2], dtype=F64))
    torch.testing.assert_close(stats["frac_high_L"], torch.tensor([0.4, 0.0], dtype=F64))
    torch.testing.assert_close(stats["frac_binary_L"], torch.tensor([0.6, 0.2], dtype=F64))
    expected_mean = [(0.01 + 0.5 + 0.97 + 0.05 + 0.96) / 5, (0.2 + 0.3 + 0.4 + 0.95 + 0.001) / 5]
    torch.testing.assert_close(stats["mean_L"], torch.tensor(expected_mean, dtype=F64))
    pooled = pooled_gate_stats(gate_sums(g, lengths))
    assert pooled["frac_binary"] == pytest.approx(0.4)
    assert pooled["mean"] == pytest.approx(sum(expected_mean) / 2)


def test_gate_sums_accumulate_across_batches():
    g, lengths = hand_gates()
    whole = gate_sums(g, lengths)
    from_list = gate_sums([g[0], g[1]], lengths)  # per-layer gates_BT, as a model may give them
    halves = gate_sums(g[:, :1], lengths[:1]) + gate_sums(g[:, 1:], lengths[1:])
    for other in (from_list, halves):
        for a, b in zip(whole.__dict__.values(), other.__dict__.values(), strict=True):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="cannot add gate sums"):
        whole + GateSums(*(x[:1] for x in whole.__dict__.values()))
    table = gate_stats_table(whole, first_layer=0)
    assert table.columns.tolist() == [
        "layer",
        "mean",
        "frac_low",
        "frac_high",
        "frac_binary",
        "count",
    ]
    assert table.frac_binary.tolist() == pytest.approx([0.6, 0.2])
    assert table["count"].tolist() == [5, 5]
    ratios = gate_stats(whole)
    assert ratios["frac_low_L"].tolist() == pytest.approx([0.2, 0.2])


def test_gate_sums_reject_bad_shapes():
    g, lengths = hand_gates()
    with pytest.raises(ValueError, match="gates_LBT must have shape"):
        gate_sums(g[0], lengths)
    with pytest.raises(ValueError, match="lengths_B shape"):
        gate_sums(g, torch.tensor([3]))


# ---- token categories --------------------------------------------------------------------


@pytest.mark.parametrize(
    "piece, category",
    [
        (" the", "stopword"),
        ("The", "stopword"),
        (" It", "stopword"),
        ("'s", "stopword"),
        (",", "punctuation"),
        (" (", "punctuation"),
        (' ."', "punctuation"),
        ("$", "punctuation"),
        ("\n\n", "newline"),
        ("\n", "newline"),
        (" \n", "newline"),
        ("  ", "whitespace"),
        ("\t", "whitespace"),
        (" 1999", "digits"),
        ("42", "digits"),
        (" cat", "content"),
        ("ing", "content"),
        ("1.5", "content"),
        ("\ufffd", "content"),
    ],
)
def test_token_category(piece, category):
    assert token_category(piece) == category


def test_token_category_rejects_empty():
    with pytest.raises(ValueError, match="non-empty string"):
        token_category("")


def test_gate_by_category_by_hand():
    pieces = [" the", " cat", ",", " the", "\n", " 1999", " dog", "  "]
    gates = torch.tensor([0.1, 0.8, 0.5, 0.3, 0.2, 0.9, 0.6, 1.0])
    table = gate_by_category(pieces, gates).set_index("category")
    assert list(table.index) == list(CATEGORIES)
    assert table.loc["stopword", "count"] == 2
    assert table.loc["stopword", "mean_gate"] == pytest.approx(0.2)
    assert table.loc["content", "mean_gate"] == pytest.approx(0.7)
    assert table.loc["punctuation", "mean_gate"] == pytest.approx(0.5)
    assert table.loc["newline", "mean_gate"] == pytest.approx(0.2)
    assert table.loc["digits", "mean_gate"] == pytest.approx(0.9)
    assert table.loc["whitespace", "mean_gate"] == pytest.approx(1.0)
    # Two layers: each position's gate is its mean over layers.
    two_layers = torch.stack([gates, 1.0 - gates])
    pooled = gate_by_category(pieces, two_layers).set_index("category")
    assert pooled.mean_gate.tolist() == pytest.approx([0.5] * 6)
    assert pooled["count"].sum() == len(pieces)
    empty = gate_by_category([" cat"], np.array([0.3])).set_index("category")
    assert empty.loc["digits", "count"] == 0 and math.isnan(empty.loc["digits", "mean_gate"])
    with pytest.raises(ValueError, match="gates must have shape"):
        gate_by_category(pieces, gates[:3])


def test_extreme_tokens():
    pieces = [" the", " cat", " the", " a", " cat", "\n", " dog"]
    gates = [0.1, 0.9, 0.3, 0.05, 0.7, 0.5, 0.95]
    table = extreme_tokens(pieces, gates, k=2)
    low = table[table.end == "lowest"]
    assert low.piece.tolist() == [" a", " the"] and low["rank"].tolist() == [1, 2]
    assert low.mean_gate.tolist() == pytest.approx([0.05, 0.2])
    high = table[table.end == "highest"]
    assert high.piece.tolist() == [" dog", " cat"]
    assert high["count"].tolist() == [1, 2] and high.category.tolist() == ["content"] * 2
    frequent = extreme_tokens(pieces, gates, k=5, min_count=2)
    assert isinstance(frequent, pd.DataFrame)
    assert frequent[frequent.end == "lowest"].piece.tolist() == [" the", " cat"]
    with pytest.raises(ValueError, match="k and min_count"):
        extreme_tokens(pieces, gates, k=0)
