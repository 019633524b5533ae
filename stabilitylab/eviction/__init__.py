"""KV-cache eviction at inference: a real cache, gate / H2O / KeyDiff policies, the protocol.

    from stabilitylab.data.text import open_corpus
    from stabilitylab.eviction import (H2O, KeyDiff, NoEviction, EvalSet, Split, evaluate,
        evaluate_baseline, evaluate_selected, matched_budget, select_tau, sweep_tau)

    shards = open_corpus()
    val = EvalSet.from_shards(shards, Split.VAL, context_len=512)
    test = EvalSet.from_shards(shards, Split.TEST, context_len=512)
    sweep = sweep_tau(gated, val)                      # 15 taus, validation only
    sel = select_tau(sweep)                            # tau*, frozen (Delta ln PPL <= 0.0045)
    gate_test = evaluate_selected(gated, test, sel, record_steps=True)  # tau* on test
    dense_test = evaluate(dense, test, NoEviction())
    budget = matched_budget(gate_test)                 # per window, step and layer
    h2o = evaluate_baseline(dense, test, H2O(), budget)
    keydiff = evaluate_baseline(dense, test, KeyDiff(), budget)

Modules: ``cache`` (one layer's cache, physical removal), ``policies`` (which entries go),
``decode`` (prefill + teacher-forced decode through the model's weights; the reference),
``masked`` (the gate-threshold decode in one masked pass: the sweeps over whole splits), ``protocol``
(decode-window PPL, compression, sweep, selection, matched budgets), ``cells`` (trained cells
loaded back), ``study`` (the study's tables), ``speed`` (decode wall-clock at tau* vs tau = 0),
``pairs`` (the study in one process per dense / gated pair).
"""

from stabilitylab.eviction.cache import LayerCache
from stabilitylab.eviction.decode import DecodeOutput, check_decoder, decode_nll
from stabilitylab.eviction.policies import H2O, GateThreshold, KeyDiff, NoEviction
from stabilitylab.eviction.protocol import (
    MAX_DELTA_LOG_PPL,
    MAX_DELTA_PPL,
    TAU_GRID,
    Budget,
    DecodeSplit,
    EvalResult,
    EvalSet,
    RecordedSelection,
    Selection,
    Split,
    Sweep,
    TauRule,
    evaluate,
    evaluate_baseline,
    evaluate_selected,
    full_budget,
    matched_budget,
    select_tau,
    select_tau_index,
    sweep_tau,
    test_sweep,
)

__all__ = [
    "H2O",
    "MAX_DELTA_LOG_PPL",
    "MAX_DELTA_PPL",
    "TAU_GRID",
    "Budget",
    "DecodeOutput",
    "DecodeSplit",
    "EvalResult",
    "EvalSet",
    "GateThreshold",
    "KeyDiff",
    "LayerCache",
    "NoEviction",
    "RecordedSelection",
    "Selection",
    "Split",
    "Sweep",
    "TauRule",
    "check_decoder",
    "decode_nll",
    "evaluate",
    "evaluate_baseline",
    "evaluate_selected",
    "full_budget",
    "matched_budget",
    "select_tau",
    "select_tau_index",
    "sweep_tau",
    "test_sweep",
]
