"""KV eviction: the cache, the decode loop against the full forward pass, policies, protocol."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from stabilitylab.config import ModelConfig
from stabilitylab.data.text.windows import EvalWindows
from stabilitylab.eviction import (
    H2O,
    TAU_GRID,
    Budget,
    DecodeSplit,
    EvalSet,
    GateThreshold,
    KeyDiff,
    LayerCache,
    NoEviction,
    RecordedSelection,
    Selection,
    Split,
    Sweep,
    TauRule,
    check_decoder,
    decode_nll,
    evaluate,
    evaluate_baseline,
    evaluate_selected,
    full_budget,
    matched_budget,
    select_tau,
    select_tau_index,
    sweep_tau,
)
from stabilitylab.eviction.policies import keydiff_score_BHN, lowest_k_BHN, newest_k_BHN
from stabilitylab.model import Transformer

F64 = torch.float64
VOCAB = 40


def tiny_decoder(
    seed, backend="softmax", gates=True, position="rope", n_layers=3, qk_norm="rmsnorm",
    d_model=16, std=0.4, dtype=torch.float64, **kw,
):  # fmt: skip
    """A decoder (float64 unless ``dtype`` says) with weights large enough (``std``) that
    attention is not uniform and the gates spread over (0, 1); 2 heads, d_ff = 2 d_model. The gate
    modules stay float32: ``TokenGate`` computes in float32 by design, in the model's full pass
    and in the decode alike."""
    torch.manual_seed(seed)
    cfg = ModelConfig(
        n_layers=n_layers, d_model=d_model, n_heads=2, d_ff=2 * d_model, dropout=0.0,
        causal=True, gates=gates, position=position, qk_norm=qk_norm, **kw,
    )  # fmt: skip
    model = Transformer(cfg, VOCAB, 32, backend).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "gate" not in name:
                p.normal_(0.0, std)
        for b in model.blocks:
            if b.gate_out is not None:
                b.gate_out.float()
                b.gate_out.weight_GC.normal_(0.0, 1.5)
                b.gate_out.bias_G.fill_(0.0)
    return model.eval()


def random_tokens(seed, B=3, S=21) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(seed + 1))


def full_pass_nll_BW(model, tokens_BS, prefill):
    """Per-token NLL of the decode window from one forward pass over all inputs."""
    B, S = tokens_BS.shape
    with torch.no_grad():
        logits_BTV = model(tokens_BS[:, :-1], torch.full((B,), S - 1))
    logp_BTV = torch.log_softmax(logits_BTV.to(F64), dim=-1)
    nll_BT = -logp_BTV.gather(2, tokens_BS[:, 1:, None])[..., 0]
    return nll_BT[:, prefill:], [g.detach() for g in model.gates]


def tolerance(model) -> float:
    # Gated models round their hidden state to float32 for the gate (model.TokenGate), so the
    # decode and the full pass can differ by float32 rounding there; the rest is float64.
    return 1e-6 if model.cfg.gates else 1e-10


# ---- the decode loop reproduces the full forward pass -----------------------------------------


CASES = list(itertools.product(["softmax", "sigmoid-reference"], [False, True], ["rope", "none"]))


@pytest.mark.parametrize("backend,gates,position", CASES)
def test_tau0_decode_equals_full_forward(seed, backend, gates, position):
    model = tiny_decoder(seed, backend, gates, position)
    tokens_BS = random_tokens(seed)
    ref_BW, _ = full_pass_nll_BW(model, tokens_BS, prefill=8)
    policy = GateThreshold(0.0) if gates else NoEviction()
    out = decode_nll(model, tokens_BS, 8, policy)
    assert out.nll_BW.shape == (3, 12)
    torch.testing.assert_close(out.nll_BW, ref_BW, rtol=0, atol=tolerance(model))
    assert (out.live_BL == out.written_per_layer).all()
    assert out.written_per_layer == 2 * 20


def test_learned_positions_and_layernorm_decode_equals_full_forward(seed):
    model = tiny_decoder(
        seed, "sigmoid-reference", gates=False, position="learned", qk_norm="layernorm"
    )
    tokens_BS = random_tokens(seed)
    ref_BW, _ = full_pass_nll_BW(model, tokens_BS, prefill=5)
    torch.testing.assert_close(
        decode_nll(model, tokens_BS, 5, NoEviction()).nll_BW, ref_BW, rtol=0, atol=1e-10
    )


@pytest.mark.parametrize("policy", [H2O(), KeyDiff()], ids=["h2o", "keydiff"])
@pytest.mark.parametrize("backend", ["softmax", "sigmoid-reference"])
def test_baselines_at_full_budget_equal_dense(seed, policy, backend):
    model = tiny_decoder(seed, backend, gates=False)
    tokens_BS = random_tokens(seed)
    dense = decode_nll(model, tokens_BS, 8, NoEviction())
    full_BL = torch.full((3, 3), 20)
    out = decode_nll(model, tokens_BS, 8, policy, keep_BL=full_BL)
    torch.testing.assert_close(out.nll_BW, dense.nll_BW, rtol=0, atol=1e-12)
    assert (out.live_BL == dense.live_BL).all()


# ---- physical eviction --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["softmax", "sigmoid-reference"])
def test_gate_removes_exactly_the_entries_below_tau(seed, backend):
    model = tiny_decoder(seed, backend)
    tokens_BS = random_tokens(seed, B=1)
    _, gates = full_pass_nll_BW(model, tokens_BS, prefill=8)
    g_sorted = gates[0][0].sort().values
    tau = float(g_sorted[9] + g_sorted[10]) / 2  # half of layer 1's entries go; no tie at tau
    out = decode_nll(model, tokens_BS, 8, GateThreshold(tau))
    c0, c1 = out.caches[0], out.caches[1]
    # Layer 0 precedes every eviction, so its gates equal the full pass's: layer 1 keeps exactly
    # the tokens whose layer-0 gate is at least tau, in both heads, and nothing else.
    kept = (gates[0][0] >= tau).nonzero()[:, 0]
    assert 0 < len(kept) < 20
    assert c0.pos_BHN[0].tolist() == [list(range(20))] * 2
    assert c1.pos_BHN[0].tolist() == [kept.tolist()] * 2
    # Physically gone: the tensors hold the live entries only (one sequence, no padding).
    assert c1.k_BHND.shape == (1, 2, len(kept), 8) and c1.v_BHND.shape == c1.k_BHND.shape
    assert c1.kv_bytes() == 2 * 2 * len(kept) * 8 * 8
    for c in out.caches[1:]:
        assert (c.g_BHN >= tau).all()
    assert int(out.live_BL[0, 1]) == 2 * len(kept)
    assert int(out.live_BL[0, 0]) == 2 * 20
    # The decode steps read fewer keys than the dense decode.
    dense = decode_nll(model, tokens_BS, 8, GateThreshold(0.0))
    assert (out.keys_read_BL[:, 0] == dense.keys_read_BL[:, 0]).all()
    assert int(out.keys_read_BL[0, 1]) < int(dense.keys_read_BL[0, 1])
    assert (out.keys_read_BL <= dense.keys_read_BL).all()
    assert int(dense.keys_read_BL[0, 0]) == 2 * sum(t + 1 for t in range(8, 20))


def below_one_gates(model):
    """Gate logits in [-1, 1]: no float32 gate rounds to exactly 1, so tau = 1 drops them all."""
    with torch.no_grad():
        for b in model.blocks:
            if b.gate_out is not None:
                b.gate_out.weight_GC.zero_()
                b.gate_out.bias_G.uniform_(-1.0, 1.0)
    return model


def test_tau_one_evicts_every_gated_layer_and_still_decodes(seed):
    model = below_one_gates(tiny_decoder(seed, "softmax"))
    out = decode_nll(model, random_tokens(seed), 8, GateThreshold(1.0))
    assert out.live_BL[:, 0].tolist() == [40] * 3
    assert (out.live_BL[:, 1:] == 0).all()  # every entry left right after its step
    assert all(c.k_BHND.shape[2] == 0 for c in out.caches[1:])
    assert torch.isfinite(out.nll_BW).all()  # each query still saw its own entry


@dataclass(frozen=True)
class Poisoning:
    """Wraps a policy: before entries are removed, their keys and values become NaN. If any
    later step read one, its output (and the NLL) would be NaN."""

    inner: object

    @property
    def needs_scores(self):
        return self.inner.needs_scores

    @property
    def needs_budget(self):
        return self.inner.needs_budget

    @property
    def name(self):
        return f"poisoned {self.inner.name}"

    def drop_BHN(self, cache: LayerCache, keep_B):
        drop_BHN = self.inner.drop_BHN(cache, keep_B)
        if drop_BHN is not None:
            cache.k_BHND = cache.k_BHND.masked_fill(drop_BHN[..., None], float("nan"))
            cache.v_BHND = cache.v_BHND.masked_fill(drop_BHN[..., None], float("nan"))
        return drop_BHN


@pytest.mark.parametrize("kind", ["gate", "h2o", "keydiff"])
@pytest.mark.parametrize("backend", ["softmax", "sigmoid-reference"])
def test_evicted_entries_are_never_read_again(seed, kind, backend):
    model = tiny_decoder(seed, backend, gates=kind == "gate")
    tokens_BS = random_tokens(seed)  # 3 sequences: the gate leaves rows of unequal length
    policy = {"gate": GateThreshold(0.5), "h2o": H2O(), "keydiff": KeyDiff()}[kind]
    keep_BL = None if kind == "gate" else torch.tensor([[20, 7, 11], [20, 3, 0], [20, 12, 5]])
    clean = decode_nll(model, tokens_BS, 8, policy, keep_BL)
    poisoned = decode_nll(model, tokens_BS, 8, Poisoning(policy), keep_BL)
    assert (clean.live_BL < clean.written_per_layer).any()
    assert torch.isfinite(poisoned.nll_BW).all()
    torch.testing.assert_close(poisoned.nll_BW, clean.nll_BW, rtol=0, atol=0)
    for c in poisoned.caches:
        assert not torch.isnan(c.k_BHND).any() and not torch.isnan(c.v_BHND).any()
    if keep_BL is not None:  # a budget is met exactly at the end, in every head
        for layer, c in enumerate(clean.caches):
            assert (c.live_count_BH() == keep_BL[:, layer, None]).all()


@pytest.mark.parametrize("kind", ["gate", "h2o"])
@pytest.mark.parametrize("backend", ["softmax", "sigmoid-reference"])
def test_a_batch_decodes_as_its_sequences_alone(seed, kind, backend):
    """Rows of a batch keep different counts (padding after compaction); each row must still
    equal its own single-sequence decode."""
    model = tiny_decoder(seed, backend, gates=kind == "gate")
    tokens_BS = random_tokens(seed)
    policy = GateThreshold(0.5) if kind == "gate" else H2O()
    keep_BL = None if kind == "gate" else torch.tensor([[20, 6, 9], [20, 2, 14], [20, 11, 4]])
    batch = decode_nll(model, tokens_BS, 8, policy, keep_BL)
    for b in range(3):
        keep = None if keep_BL is None else keep_BL[b : b + 1]
        one = decode_nll(model, tokens_BS[b : b + 1], 8, policy, keep)
        torch.testing.assert_close(
            batch.nll_BW[b : b + 1], one.nll_BW, rtol=0, atol=tolerance(model)
        )
        assert (batch.live_BL[b] == one.live_BL[0]).all()


def test_h2o_scores_are_the_attention_received(seed):
    model = tiny_decoder(seed, "softmax", gates=False)
    out = decode_nll(model, random_tokens(seed), 8, H2O(), keep_BL=torch.full((3, 3), 20))
    for c in out.caches:
        # softmax rows sum to 1: the 20 queries hand out 20 units per head; the last entry was
        # seen by its own query only.
        torch.testing.assert_close(c.score_BHN.sum(-1), torch.full((3, 2), 20.0, dtype=F64))
        assert (c.score_BHN[..., -1] > 0).all() and (c.score_BHN[..., -1] <= 1).all()


# ---- the policies' maths ------------------------------------------------------------------------


def hand_cache(k_BHND, pos_N, score_N=None) -> LayerCache:
    B, H, N, D = k_BHND.shape
    return LayerCache(
        k_BHND=k_BHND,
        v_BHND=torch.zeros_like(k_BHND),
        pos_BHN=pos_N.expand(B, H, N).clone(),
        live_BHN=torch.ones(B, H, N, dtype=torch.bool),
        score_BHN=None if score_N is None else score_N.to(F64).expand(B, H, N).clone(),
    )


def test_lowest_and_newest_k():
    score = torch.tensor([[[3.0, 1.0, 2.0, 1.0, 0.5]]])
    cand = torch.tensor([[[True, True, True, True, False]]])
    got = lowest_k_BHN(score, cand, torch.tensor([[2]]))
    assert got.tolist() == [[[False, True, False, True, False]]]  # 0.5 is no candidate
    assert lowest_k_BHN(score, cand, torch.tensor([[9]])).tolist() == cand.tolist()
    pos = torch.tensor([[[4, 0, 7, 2, 9]]])
    assert newest_k_BHN(pos, cand, torch.tensor([[2]])).tolist() == [
        [[True, False, True, False, False]]
    ]


def test_h2o_keeps_recent_and_heavy_hitters():
    # 8 entries, budget 4: the 2 newest (positions 6, 7) stay, and of the rest the 2 with the
    # most attention received (positions 1 and 4).
    score_N = torch.tensor([0.1, 5.0, 0.2, 0.3, 4.0, 0.0, 0.0, 0.0])
    cache = hand_cache(torch.randn(1, 1, 8, 4, dtype=F64), torch.arange(8), score_N)
    cache.compact(H2O().drop_BHN(cache, torch.tensor([4])))
    assert cache.pos_BHN.tolist() == [[[1, 4, 6, 7]]]
    assert cache.k_BHND.shape[2] == 4


def test_keydiff_keeps_the_keys_least_like_the_mean():
    # Five keys along e0 (plus noise), one along e1: the outlier scores highest and stays.
    k = torch.zeros(1, 1, 6, 4, dtype=F64)
    k[..., 0] = 1.0
    k[..., :5, 1] = torch.tensor([0.0, 0.01, -0.01, 0.02, -0.02], dtype=F64)
    k[0, 0, 5] = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=F64)
    score = keydiff_score_BHN(k, torch.ones(1, 1, 6, dtype=torch.bool))
    assert int(score[0, 0].argmax()) == 5
    cache = hand_cache(k, torch.arange(6))
    cache.compact(KeyDiff().drop_BHN(cache, torch.tensor([2])))
    assert 5 in cache.pos_BHN[0, 0].tolist() and cache.k_BHND.shape[2] == 2


def test_keydiff_ignores_whatever_the_slots_that_are_not_live_hold():
    """The decode engine's view reads keys of slots that are not live from an uninitialised
    pool: NaN or inf there must not reach the anchor (it made every score NaN, evicting none)."""
    k = torch.randn(2, 2, 7, 4, dtype=F64)
    live = torch.ones(2, 2, 7, dtype=torch.bool)
    live[..., 5:] = False
    clean = keydiff_score_BHN(k.masked_fill(~live[..., None], 0.0), live)
    k[..., 5, :], k[..., 6, :] = float("nan"), float("inf")
    dirty = keydiff_score_BHN(k, live)
    torch.testing.assert_close(dirty[live], clean[live], rtol=0, atol=0)
    cache = hand_cache(k[:1, :1], torch.arange(7))
    cache.live_BHN[..., 5:] = False
    drop = KeyDiff().drop_BHN(cache, torch.tensor([3]))
    assert int(drop.sum()) == 2 and not drop[..., 5:].any()


def test_compact_zeroes_padding_and_shrinks():
    k = torch.arange(2 * 1 * 4 * 2, dtype=F64).view(2, 1, 4, 2) + 1
    cache = hand_cache(k, torch.arange(4))
    drop = torch.tensor([[[True, False, True, False]], [[False, False, False, True]]])
    assert cache.compact(drop) == 3
    assert cache.k_BHND.shape == (2, 1, 3, 2)
    assert cache.live_count_BH().tolist() == [[2], [3]]
    assert cache.pos_BHN.tolist() == [[[1, 3, -1]], [[0, 1, 2]]]
    assert cache.k_BHND[0, 0, 2].tolist() == [0.0, 0.0]


# ---- the protocol -------------------------------------------------------------------------------


def eval_set(seed, split: Split, n_tokens=70, context_len=16) -> EvalSet:
    rng = np.random.default_rng(seed + 2)
    windows = EvalWindows(rng.integers(0, VOCAB, n_tokens), context_len, name=split.value)
    return EvalSet(split, windows)


DECODE = DecodeSplit(prefill=8, window=8)


def test_decode_split_defaults():
    assert DecodeSplit() == DecodeSplit.for_context(512) == DecodeSplit(256, 256)
    assert DecodeSplit.for_context(65) == DecodeSplit(32, 33)


def test_compression_counts_and_ppl(seed):
    model = tiny_decoder(seed, "sigmoid-reference")
    val = eval_set(seed, Split.VAL)
    assert val.indices(DECODE) == [0, 1, 2, 3]  # 70 tokens: the 5th window is short, skipped
    zero = evaluate(model, val, GateThreshold(0.0), DECODE, batch_size=3)
    assert zero.compression == 0.0 and zero.n_targets == 4 * 8
    res = evaluate(model, val, GateThreshold(0.5), DECODE, batch_size=3)
    written = 2 * 16
    assert res.written_per_layer == written
    assert res.compression_L[0] == 0.0
    assert np.allclose(res.compression_L, (written - res.live_NL).sum(0) / (4 * written))
    assert math.isclose(res.compression, res.compression_L.mean())
    assert math.isclose(res.compression_evictable, res.compression_L[1:].mean())
    assert 0.0 < res.compression < 2 / 3  # layer 0 keeps everything: at most (L-1)/L
    # PPL = exp(mean NLL) of the decode windows, the same as four separate decodes.
    nll = [
        decode_nll(model, val.tokens_BS([k], DECODE), 8, GateThreshold(0.5)).nll_BW
        for k in range(4)
    ]
    # evaluate runs the masked one-pass path: equal to the loop up to float32 gate rounding.
    assert math.isclose(res.ppl, math.exp(torch.cat(nll, 1).mean().item()), rel_tol=1e-6)
    loop = evaluate(model, val, GateThreshold(0.5), DECODE, batch_size=3, fast=False)
    assert math.isclose(loop.ppl, math.exp(torch.cat(nll, 1).mean().item()), rel_tol=1e-9)
    full = evaluate(below_one_gates(model), val, GateThreshold(1.0), DECODE)
    assert math.isclose(full.compression, 2 / 3)
    assert np.allclose(full.live_kv_bytes_L, [32 * 2 * 8 * 8, 0, 0])


def test_select_tau_rule():
    taus = [0.0, 0.01, 0.05, 0.1, 0.2]
    ppl = [20.0, 20.02, 20.09, 20.1, 21.0]
    comp = [0.0, 0.1, 0.2, 0.3, 0.5]
    # 20.1 - 20.0 is 0.10000000000000142 in floating point: past 0.1 under < and <= alike.
    assert select_tau_index(taus, ppl, comp) == 2
    # The boundary itself, in exactly representable numbers: a PPL rise equal to max_delta is
    # refused (strictly less than), one 2^-9 below it is taken.
    exact = [0.0, 0.1, 0.2]
    assert select_tau_index(exact, [16.0, 16.0625, 16.125], [0.0, 0.25, 0.5], 0.125) == 1
    assert select_tau_index(exact, [16.0, 16.0625, 16.123046875], [0.0, 0.25, 0.5], 0.125) == 2
    assert select_tau_index(taus, ppl, [0.0, 0.2, 0.2, 0.3, 0.5]) == 1  # tie: the smaller tau
    assert select_tau_index(taus, [20.0, 25, 25, 25, 25], comp) == 0
    assert len(TAU_GRID) == 15 and TAU_GRID[0] == 0.0


def test_the_relative_rule_takes_its_bound_and_refuses_nan():
    """Delta ln PPL <= max_delta: a zero tolerance still takes an equal PPL (``<`` would not)."""
    assert TauRule("relative", 0.0).accepts(16.0, 16.0)
    assert not TauRule("relative", 0.0).accepts(16.000001, 16.0)
    rule = TauRule()
    assert rule.accepts(16.0 * 1.0045, 16.0) and not rule.accepts(16.0 * 1.0046, 16.0)
    assert not rule.accepts(float("nan"), 16.0) and not rule.accepts(16.0, float("nan"))
    taus, comp = [0.0, 0.1, 0.2], [0.0, 0.2, 0.4]
    # ln(20.08 / 20) = 0.0040 is taken, ln(20.1 / 20) = 0.0050 is not.
    assert select_tau_index(taus, [20.0, 20.08, 20.1], comp, rule=rule) == 1
    assert select_tau_index(taus, [float("nan"), 20.0, 20.0], comp, rule=rule) == 0  # no reference
    with pytest.raises(ValueError, match="relative or absolute"):
        TauRule("ratio")
    with pytest.raises(ValueError, match=">= 0"):
        TauRule("relative", -0.1)


def test_tau_is_selected_on_validation_and_frozen_for_test(seed):
    model = tiny_decoder(seed, "sigmoid-reference", n_layers=2)
    val, test = eval_set(seed, Split.VAL), eval_set(seed + 7, Split.TEST)
    with pytest.raises(ValueError, match="validation split only"):
        sweep_tau(model, test, decode=DECODE)
    sweep = sweep_tau(model, val, grid=(0.0, 0.3, 0.6), decode=DECODE, max_windows=2)
    sel = select_tau(sweep)
    ref = sweep.results[0].ppl
    rule = TauRule()  # the default: Delta ln PPL <= 0.0045
    rows = zip(sweep.taus, sweep.results, strict=True)
    ok = [(r.compression, t) for t, r in rows if rule.accepts(r.ppl, ref)]
    best = max(c for c, _ in ok)
    assert sel.tau == min(t for c, t in ok if c == best)  # the rule, ties to the smaller tau
    assert sel.val_result.compression == best
    with pytest.raises(ValueError, match="validation only"):
        Selection(Sweep(Split.TEST, sweep.fingerprint, sweep.taus, sweep.results))
    with pytest.raises(ValueError, match="frozen on validation"):
        evaluate(model, test, GateThreshold(0.3), DECODE)
    with pytest.raises(ValueError, match="runs on the test split"):
        evaluate_selected(model, val, sel)
    with pytest.raises(ValueError, match="needs a Selection"):
        evaluate_selected(model, test, 0.3)
    other = tiny_decoder(seed + 1, "sigmoid-reference", n_layers=2)
    with pytest.raises(ValueError, match="another model"):
        evaluate_selected(other, test, sel)
    res = evaluate_selected(model, test, sel, max_windows=2)
    assert res.split is Split.TEST and res.policy == f"gate(tau={sel.tau:g})"
    assert res.decode == DECODE and len(res.window_indices) == 2


def test_a_recorded_sweep_freezes_the_same_tau_star_for_another_process(seed):
    """The rule applied again to a sweep's recorded validation numbers: the same tau*, the same
    test run; tau* is never an argument, and the fingerprint binds it to the swept model."""
    model = tiny_decoder(seed, "sigmoid-reference", n_layers=2)
    val, test = eval_set(seed, Split.VAL), eval_set(seed + 7, Split.TEST)
    sweep = sweep_tau(model, val, grid=(0.0, 0.3, 0.6), decode=DECODE, max_windows=2)
    ppl, comp = [r.ppl for r in sweep.results], [r.compression for r in sweep.results]
    rec = RecordedSelection(sweep.fingerprint, DECODE, sweep.taus, tuple(ppl), tuple(comp))
    sel = select_tau(sweep)
    assert rec.tau == sel.tau and rec.decode == sel.decode == DECODE
    a = evaluate_selected(model, test, rec, max_windows=2)
    b = evaluate_selected(model, test, sel, max_windows=2)
    assert a.ppl == b.ppl and a.policy == b.policy
    # Recorded compressions that favour 0.6 within the PPL limit: the rule picks it, not a caller.
    lax = RecordedSelection(
        sweep.fingerprint, DECODE, sweep.taus, (5.0, 5.05, 5.09), (0, 0.1, 0.2), TauRule.paper()
    )
    assert lax.tau == 0.6
    # The same numbers under the default relative rule: ln(5.05 / 5) = 0.00995 > 0.0045.
    strict = RecordedSelection(
        sweep.fingerprint, DECODE, sweep.taus, (5.0, 5.05, 5.09), (0, 0.1, 0.2)
    )
    assert strict.tau == 0.0
    with pytest.raises(ValueError, match="another model"):
        evaluate_selected(tiny_decoder(seed + 1, "sigmoid-reference", n_layers=2), test, rec)
    with pytest.raises(ValueError, match="must contain 0"):
        RecordedSelection(sweep.fingerprint, DECODE, (0.3, 0.6), (1.0, 1.0), (0.0, 0.0))
    with pytest.raises(ValueError, match="3 taus, 2 PPLs"):
        RecordedSelection(sweep.fingerprint, DECODE, sweep.taus, (1.0, 1.0), tuple(comp))


def test_baselines_match_the_gates_final_live_cache(seed):
    gated = tiny_decoder(seed, "sigmoid-reference")
    dense = tiny_decoder(seed + 1, "sigmoid-reference", gates=False)
    val = eval_set(seed, Split.VAL)
    gate = evaluate(gated, val, GateThreshold(0.5), DECODE)
    budget = matched_budget(gate, mode="final")
    for policy in (H2O(), KeyDiff()):
        res = evaluate_baseline(dense, val, policy, budget, batch_size=3)
        assert (res.live_NL == gate.live_NL).all()  # every window, every layer
        assert math.isclose(res.compression, gate.compression)
    # Zero budget reduction: the baselines are the dense run.
    dense_res = evaluate(dense, val, NoEviction(), DECODE)
    full = full_budget(val, 3, 2, DECODE)
    for policy in (H2O(), KeyDiff()):
        res = evaluate_baseline(dense, val, policy, full)
        assert math.isclose(res.ppl, dense_res.ppl, rel_tol=1e-12) and res.compression == 0.0


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [-0.1, 1.5, float("nan"), "0.1"])
def test_tau_outside_unit_interval_is_refused(tau):
    with pytest.raises(ValueError, match=r"tau must be a number in \[0, 1\]"):
        GateThreshold(tau)


def test_bad_grids_are_refused(seed):
    model = tiny_decoder(seed, n_layers=2)
    val = eval_set(seed, Split.VAL)
    with pytest.raises(ValueError, match="must contain 0"):
        sweep_tau(model, val, grid=(0.1, 0.2), decode=DECODE)
    with pytest.raises(ValueError, match=r"tau must be a number in \[0, 1\], got 2.0"):
        sweep_tau(model, val, grid=(0.0, 2.0), decode=DECODE)


def test_budget_larger_than_the_sequence_is_refused(seed):
    dense = tiny_decoder(seed, gates=False)
    with pytest.raises(ValueError, match=r"budget of 21 entries per head \(sequence 1, layer 2\)"):
        decode_nll(
            dense,
            random_tokens(seed),
            8,
            H2O(),
            keep_BL=torch.tensor([[20] * 3, [20, 20, 21], [1] * 3]),
        )
    val = eval_set(seed, Split.VAL)
    budget = full_budget(val, 3, 2, DECODE)
    big = Budget(Split.VAL, DECODE, budget.window_indices, budget.live_NL + 2, "hand-made")
    with pytest.raises(
        ValueError,
        match=r"budget of 17 entries per head \(window 0, layer 0\) exceeds the sequence's 16",
    ):
        evaluate_baseline(dense, val, KeyDiff(), big)
    with pytest.raises(ValueError, match="keeps a budget: pass keep_BL"):
        decode_nll(dense, random_tokens(seed), 8, H2O())
    with pytest.raises(ValueError, match="budget from the val split used on test"):
        evaluate_baseline(dense, eval_set(seed, Split.TEST), H2O(), budget)


def test_encoder_and_per_head_gates_are_refused(seed):
    cfg = ModelConfig(n_layers=2, d_model=16, n_heads=2, d_ff=32, causal=False)
    encoder = Transformer(cfg, VOCAB, 32, "softmax")
    with pytest.raises(ValueError, match=r"runs/enc/ckpt.pt: model.causal=False \(an encoder"):
        check_decoder(encoder, source="runs/enc/ckpt.pt")
    with pytest.raises(ValueError, match="model.causal=False"):
        decode_nll(encoder, random_tokens(seed), 8, NoEviction())
    per_head = tiny_decoder(seed, gate_per_head=True)
    with pytest.raises(ValueError, match="gate_per_head=True is not supported"):
        decode_nll(per_head, random_tokens(seed), 8, GateThreshold(0.1))
    with pytest.raises(ValueError, match=r"prefill must be in \[1, 19\]"):
        decode_nll(tiny_decoder(seed), random_tokens(seed), 20, NoEviction())
