"""The study's decode-window evaluation (``eviction/protocol.py``) through the decode engine: the
same windows, batches, PPL, compression, live and read entries, as an ``EvalResult``.

    engine = DecodeEngine(model, batch=inputs.batch_size, max_entries=decode.n_inputs,
                          policy=GateThreshold(0.0))
    dense = evaluate_engine(engine, test_set, decode, batch_size=inputs.batch_size)
    tau_star = evaluate_selected_engine(engine_at_tau_star, test_set, selection)

The protocol's guard holds here too: a gate threshold other than 0 runs on the test split only
through ``evaluate_selected_engine``, whose engine must hold the selection's tau* and the
selected model (its fingerprint). ``allocated_kv_bytes_L`` is the bytes of the pages the windows'
rows held at the end (the engine's memory; the research loop's counted its padded tensors).
"""

from __future__ import annotations

import numpy as np
import torch

from stabilitylab.eviction.policies import GateThreshold
from stabilitylab.eviction.protocol import (
    DecodeSplit,
    EvalResult,
    EvalSet,
    RecordedSelection,
    Selection,
    Split,
    model_fingerprint,
    window_indices_of,
)
from stabilitylab.inference.engine import DecodeEngine


def _run(engine, evalset, decode, indices, batch_size, keep_NL, progress) -> EvalResult:
    nll, n_targets, live, read, held = [], 0, [], [], 0
    batches = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc=f"engine {engine.policy.name}", leave=False)
    start = 0
    for idx in batches:
        keep_BL = None if keep_NL is None else torch.from_numpy(keep_NL[start : start + len(idx)])
        out = engine.teacher_forced(evalset.tokens_BS(idx, decode), decode.prefill, keep_BL=keep_BL)
        start += len(idx)
        nll.append(out.nll_BW.sum(1).double().cpu().numpy())
        n_targets += out.nll_BW.numel()
        live.append(out.live_BL.cpu().numpy())
        read.append(out.keys_read_BL.cpu().numpy())
        held = held + np.asarray(out.held_bytes_L)
    model = engine.model
    return EvalResult(
        split=evalset.split, policy=engine.policy.name, fingerprint=model_fingerprint(model),
        decode=decode, n_heads=model.cfg.n_heads, window_indices=tuple(indices),
        nll_N=np.concatenate(nll), n_targets=n_targets, written_per_layer=model.cfg.n_heads * decode.n_inputs,
        live_NL=np.concatenate(live), keys_read_NL=np.concatenate(read),
        bytes_per_entry=engine.caches[0].entry_bytes(), allocated_kv_bytes_L=held,
    )  # fmt: skip


def _check_engine(engine: DecodeEngine, decode: DecodeSplit, batch: int) -> None:
    """``batch``: the largest batch of windows the evaluation will step."""
    if batch > engine.batch:
        raise ValueError(f"a batch of {batch} windows exceeds the engine's {engine.batch} rows")
    room = engine.caches[0].table_BHM.shape[2] * engine.caches[0].page_size
    if decode.n_inputs > min(room, engine.max_position):
        raise ValueError(
            f"the engine holds {min(room, engine.max_position)} tokens per row, the decode "
            f"split needs {decode.n_inputs}"
        )


def evaluate_engine(
    engine: DecodeEngine,
    evalset: EvalSet,
    decode: DecodeSplit,
    *,
    batch_size: int = 16,
    max_windows: int | None = None,
    keep_NL: np.ndarray | None = None,
    progress: bool = False,
) -> EvalResult:
    """``protocol.evaluate`` (and, with ``keep_NL``, ``evaluate_baseline``'s loop) through
    ``engine`` and its policy."""
    policy = engine.policy
    if evalset.split is Split.TEST and isinstance(policy, GateThreshold) and policy.tau != 0:
        raise ValueError(
            f"{policy.name} on the test split: test runs at the tau* frozen on validation; "
            "use evaluate_selected_engine"
        )
    indices = window_indices_of(evalset, decode, max_windows)
    _check_engine(engine, decode, min(batch_size, len(indices)))
    return _run(engine, evalset, decode, indices, batch_size, keep_NL, progress)


def evaluate_selected_engine(
    engine: DecodeEngine,
    test_set: EvalSet,
    selection: Selection | RecordedSelection,
    *,
    batch_size: int = 16,
    max_windows: int | None = None,
    progress: bool = False,
) -> EvalResult:
    """``protocol.evaluate_selected`` through ``engine``, which must run ``GateThreshold`` at
    the selection's tau* on the selected model."""
    if not isinstance(selection, (Selection, RecordedSelection)):
        raise ValueError(f"evaluate_selected_engine needs a Selection, got {type(selection)}")
    if test_set.split is not Split.TEST:
        raise ValueError(f"evaluate_selected_engine runs on the test split, got {test_set.split.value}")  # fmt: skip
    if engine.policy != GateThreshold(selection.tau):
        raise ValueError(f"the engine runs {engine.policy.name}, the selection's tau* is {selection.tau}")  # fmt: skip
    if model_fingerprint(engine.model) != selection.fingerprint:
        raise ValueError("this tau* was selected on another model (fingerprints differ)")
    decode = selection.decode
    indices = window_indices_of(test_set, decode, max_windows)
    _check_engine(engine, decode, min(batch_size, len(indices)))
    return _run(engine, test_set, decode, indices, batch_size, None, progress)


def study_engine(model, tau: float, batch: int, decode: DecodeSplit, **kw) -> DecodeEngine:
    """An engine for the study's windows: ``batch`` rows (the evaluation's largest batch of
    windows; a smaller one is padded) of ``decode.n_inputs`` tokens."""
    n = decode.n_inputs
    return DecodeEngine(
        model, batch=batch, max_entries=n, max_position=n, policy=GateThreshold(tau), **kw
    )
