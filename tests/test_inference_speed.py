"""The study's decode-speed table through the engine (eviction/speed.py, inference/evaluate.py):
the engine's evaluations equal the research loop's (PPL, live entries, reads), the table says
which path timed it and carries the comparison, and the protocol's guards hold. No speed is
asserted."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from stabilitylab.eviction import GateThreshold, RecordedSelection, Split, evaluate
from stabilitylab.eviction.protocol import evaluate_selected, model_fingerprint
from stabilitylab.eviction.speed import DECODE_SPEED_COLUMNS, decode_speed
from stabilitylab.eviction.study import StudyInputs
from stabilitylab.inference.evaluate import (
    evaluate_engine,
    evaluate_selected_engine,
    study_engine,
)
from tests.test_eviction import DECODE, eval_set, tiny_decoder
from tests.test_inference_engine import evicting_tau


def setup(seed, backend="sigmoid-reference"):
    """A gated model, val / test windows and a recorded tau* that evicts (the rule picks the
    grid point with the higher compression at an equal PPL)."""
    model = tiny_decoder(seed, backend, gates=True)
    val, test = eval_set(seed, Split.VAL), eval_set(seed + 7, Split.TEST)
    tokens_BS = test.tokens_BS(test.indices(DECODE)[:2], DECODE)
    tau = evicting_tau(model, tokens_BS)
    selection = RecordedSelection(model_fingerprint(model), DECODE, (0.0, tau), (10.0, 10.0),
                                  (0.0, 0.5))  # fmt: skip
    assert selection.tau == tau
    inputs = StudyInputs(val, test, DECODE, None, 3, 2)  # 3 test windows in batches of 2
    return model, selection, inputs


def test_engine_evaluations_equal_the_research_loop(seed, one_thread):
    model, selection, inputs = setup(seed)
    kw = dict(batch_size=2, max_windows=3)
    dense = evaluate_engine(study_engine(model, 0.0, 2, DECODE), inputs.test, DECODE, **kw)
    ref = evaluate(model, inputs.test, GateThreshold(0.0), DECODE, **kw)
    engine = study_engine(model, selection.tau, 2, DECODE)
    evicted = evaluate_selected_engine(engine, inputs.test, selection, **kw)
    ref_evicted = evaluate_selected(model, inputs.test, selection, **kw)
    for a, b in ((dense, ref), (evicted, ref_evicted)):
        assert a.window_indices == b.window_indices and a.n_targets == b.n_targets
        assert abs(a.nll_sum - b.nll_sum) < 1e-5 * a.n_targets
        np.testing.assert_array_equal(a.live_NL, b.live_NL)
        np.testing.assert_array_equal(a.keys_read_NL, b.keys_read_NL)
        assert a.compression == b.compression
    assert evicted.compression > 0 and dense.compression == 0
    # The pages the rows hold cover their live entries, with at most one page per (row, head)
    # to spare: the page a row was given for its next write stays held when that write is not
    # kept, so a row whose every entry went still holds one page (a whole layer can end so).
    live_bytes = evicted.live_NL.sum(0) * evicted.bytes_per_entry
    slack = 3 * model.cfg.n_heads * engine.caches[0].page_size * evicted.bytes_per_entry
    assert (evicted.allocated_kv_bytes_L >= live_bytes).all()
    assert (evicted.allocated_kv_bytes_L <= live_bytes + slack).all()


def test_the_speed_table_is_timed_through_the_engine_beside_the_research_loop(seed, one_thread):
    model, selection, inputs = setup(seed)
    speed = decode_speed({"sig-g-rope": SimpleNamespace(model=model)}, {"sig-g-rope": selection},
                         inputs, repeats=2)  # fmt: skip
    assert list(speed.columns) == DECODE_SPEED_COLUMNS and len(speed) == 1
    row = speed.iloc[0]
    assert row["decode_path"] == "engine (reference)"  # CPU: PyTorch attention, eager steps
    assert row["same_live_as_research"] and row["max_ppl_diff_vs_research"] < 1e-6
    assert row["research_dense_s"] > 0 and row["research_tau_star_s"] > 0
    ref = evaluate_selected(model, inputs.test, selection, batch_size=2, max_windows=3)
    assert row["compression"] == ref.compression > 0
    assert row["decode_tokens"] == 3 * DECODE.window and row["repeats"] == 2


def test_the_engine_evaluation_keeps_the_protocol_guards(seed):
    model, selection, inputs = setup(seed)
    at_tau = study_engine(model, selection.tau, 2, DECODE)
    with pytest.raises(ValueError, match="test runs at the tau\\* frozen on validation"):
        evaluate_engine(at_tau, inputs.test, DECODE)
    with pytest.raises(ValueError, match="the selection's tau\\* is"):
        evaluate_selected_engine(study_engine(model, 0.0, 2, DECODE), inputs.test, selection)
    with pytest.raises(ValueError, match="runs on the test split"):
        evaluate_selected_engine(at_tau, inputs.val, selection)
    other = tiny_decoder(seed + 1, "sigmoid-reference", gates=True)
    with pytest.raises(ValueError, match="fingerprints differ"):
        evaluate_selected_engine(study_engine(other, selection.tau, 2, DECODE), inputs.test,
                                 selection)  # fmt: skip
    with pytest.raises(ValueError, match="a batch of 3 windows exceeds the engine's 2 rows"):
        evaluate_engine(study_engine(model, 0.0, 2, DECODE), inputs.test, DECODE, batch_size=3)
