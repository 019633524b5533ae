"""Decode wall-clock of each gated cell on test at its tau* against the same model at tau = 0.

    speed = decode_speed(cells, {name: selection}, inputs, repeats=3, alone=True)
    selections = recorded_selections(table2, table5, inputs.decode)   # tau* from a study's tables

The timed runs go through the decode engine (``stabilitylab.inference``: paged KV, the decode
kernel, CUDA-graph steps on CUDA), one engine per run kind built and warmed up (an untimed batch
of each: kernels tuned, the step captured) before the clock starts. Each cell's two runs are
timed ``repeats`` times, alternating dense / tau* (so a slow spell of the device falls on both);
the table reports the median seconds with the min and max beside them, and the speedup of the
medians. A run covers the whole evaluation (prefill included), synchronised on CUDA: a
measurement to report, never a claim the tests check.

The research loop (``eviction/decode.py``, eager, one layer at a time) stays the reference: each
run is also made once through it, after its own warm-up, timed (``research_dense_s``,
``research_tau_star_s``) and compared: ``max_ppl_diff_vs_research`` (the larger of the two runs'
|PPL difference|) and ``same_live_as_research`` (the engine kept the same number of entries in
every window and layer, both runs). ``decode_path`` names the engine's attention and whether its
steps were a CUDA graph.

``measured_alone`` says whether no other process of the study shared the device while it was
timed: True for the single-process study (training has ended) and for the parallel study, whose
per-pair processes do not time and whose parent times after they have all ended. Timing inside
those processes would read another pair's training or evaluation in its seconds (on an H200 the
same dense decode took 1.65 s in one run and 3.09 s in another).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch

from stabilitylab.eviction.cells import StudyError, TrainedCell
from stabilitylab.eviction.policies import GateThreshold
from stabilitylab.eviction.protocol import (
    DecodeSplit,
    EvalResult,
    RecordedSelection,
    Selection,
    TauRule,
    evaluate,
    evaluate_selected,
    model_fingerprint,
)

if TYPE_CHECKING:
    from stabilitylab.eviction.study import StudyInputs

DECODE_SPEED_COLUMNS = [
    "cell", "tau_star", "device", "measured_alone", "repeats", "batch_size", "n_windows",
    "decode_tokens", "dense_s", "dense_s_min", "dense_s_max", "tau_star_s", "tau_star_s_min",
    "tau_star_s_max", "dense_tokens_per_s", "tau_star_tokens_per_s", "speedup",
    "dense_live_kv_bytes", "tau_star_live_kv_bytes", "live_kv_ratio", "keys_read_ratio",
    "compression", "decode_path", "research_dense_s", "research_tau_star_s",
    "max_ppl_diff_vs_research", "same_live_as_research",
]  # fmt: skip
"""The columns up to ``compression`` are the table's first form (timed through the research
loop); the rest came with the engine (older tables lack them: NaN when merged)."""


def spread(seconds: Sequence[float]) -> tuple[float, float, float]:
    """``(median, min, max)`` of repeated timings (at least one)."""
    if not seconds:
        raise ValueError("spread needs at least one timing")
    return statistics.median(seconds), min(seconds), max(seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], EvalResult], device: torch.device) -> tuple[EvalResult, float]:
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def run_kinds(model, selection, inputs: StudyInputs, path: str):
    """``(dense, evicted, decode_path)``: the test evaluation at tau = 0 and at tau*, as
    callables taking ``evaluate``'s keyword overrides, through ``path`` (engine | research)."""
    kw = inputs.test_kwargs()
    if path == "research":
        kw["fast"] = False  # the decode loop itself, not the masked one-pass evaluation

        def dense(**over):
            return evaluate(model, inputs.test, GateThreshold(0.0), inputs.decode, **{**kw, **over})

        def evicted(**over):
            return evaluate_selected(model, inputs.test, selection, **{**kw, **over})

        return dense, evicted, "research loop"
    from stabilitylab.inference.evaluate import (
        evaluate_engine,
        evaluate_selected_engine,
        study_engine,
    )

    # As many rows as the largest batch of test windows: no padded row steps for nothing.
    n_windows = len(inputs.test.indices(inputs.decode, inputs.test_windows))
    rows = max(1, min(inputs.batch_size, n_windows))
    e_dense = study_engine(model, 0.0, rows, inputs.decode)
    e_tau = study_engine(model, selection.tau, rows, selection.decode)

    def dense(**over):
        return evaluate_engine(e_dense, inputs.test, inputs.decode, **{**kw, **over})

    def evicted(**over):
        return evaluate_selected_engine(e_tau, inputs.test, selection, **{**kw, **over})

    graph = ", cuda graph" if e_dense.graph is not None else ""
    return dense, evicted, f"engine ({e_dense.impl}{graph})"


def time_decode(model, selection, inputs: StudyInputs, repeats: int, path: str = "engine"):
    """``(dense, evicted, dense_s, evicted_s, decode_path)``: the test evaluation at tau = 0 and
    at tau* through ``path``, one untimed batch of each first (kernels, allocator, the graph),
    then ``repeats`` timed runs of each, alternating; the results are the last runs' (every run
    decodes the same windows)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    device = next(model.parameters()).device
    dense, evicted, decode_path = run_kinds(model, selection, inputs, path)
    warm = min(inputs.batch_size, inputs.test_windows or inputs.batch_size)
    dense(max_windows=warm, progress=False)
    evicted(max_windows=warm, progress=False)
    dense_s, evicted_s = [], []
    for _ in range(repeats):
        d, s = _timed(dense, device)
        dense_s.append(s)
        e, s = _timed(evicted, device)
        evicted_s.append(s)
    return d, e, dense_s, evicted_s, decode_path


def against_research(dense, evicted, research: tuple) -> dict:
    """The engine's runs beside the research loop's (``time_decode(..., path="research")``)."""
    r_dense, r_evicted, r_dense_s, r_evicted_s, _ = research
    pairs = ((dense, r_dense), (evicted, r_evicted))
    return {
        "research_dense_s": r_dense_s[0],
        "research_tau_star_s": r_evicted_s[0],
        "max_ppl_diff_vs_research": max(abs(a.ppl - b.ppl) for a, b in pairs),
        "same_live_as_research": all(np.array_equal(a.live_NL, b.live_NL) for a, b in pairs),
    }


def speed_row(
    cell: str,
    tau: float,
    dense: EvalResult,
    evicted: EvalResult,
    dense_s: Sequence[float],
    evicted_s: Sequence[float],
    **facts,
) -> dict:
    """One row of ``decode_speed`` from the two runs and their timings; ``facts``: device,
    measured_alone, batch_size and the engine's columns (``decode_path``, ``against_research``).
    Bytes: live K/V per window at the end, summed over layers."""
    d_med, d_min, d_max = spread(dense_s)
    e_med, e_min, e_max = spread(evicted_s)
    dense_bytes, evicted_bytes = dense.live_kv_bytes_L.sum(), evicted.live_kv_bytes_L.sum()
    return {
        "cell": cell, "tau_star": tau, **facts, "repeats": len(dense_s),
        "n_windows": len(dense.window_indices), "decode_tokens": dense.n_targets,
        "dense_s": d_med, "dense_s_min": d_min, "dense_s_max": d_max,
        "tau_star_s": e_med, "tau_star_s_min": e_min, "tau_star_s_max": e_max,
        "dense_tokens_per_s": dense.n_targets / d_med,
        "tau_star_tokens_per_s": evicted.n_targets / e_med,
        "speedup": d_med / e_med,
        "dense_live_kv_bytes": float(dense_bytes),
        "tau_star_live_kv_bytes": float(evicted_bytes),
        "live_kv_ratio": float(evicted_bytes / dense_bytes),
        "keys_read_ratio": float(evicted.keys_read_NL.sum() / dense.keys_read_NL.sum()),
        "compression": evicted.compression,
    }  # fmt: skip


def decode_speed(
    cells: dict[str, TrainedCell],
    selections: dict[str, Selection | RecordedSelection],
    inputs: StudyInputs,
    *,
    repeats: int = 3,
    alone: bool = True,
) -> pd.DataFrame:
    """Each selected cell on test at tau = 0 and at its tau*, timed through the engine, once
    through the research loop beside it (module docstring). ``alone``: no other process of the
    study shares the device (the ``measured_alone`` column)."""
    rows = []
    for name, selection in selections.items():
        model = cells[name].model
        dense, evicted, dense_s, evicted_s, path = time_decode(model, selection, inputs, repeats)
        research = time_decode(model, selection, inputs, 1, path="research")
        device = str(next(model.parameters()).device)
        facts = {"device": device, "measured_alone": alone, "batch_size": inputs.batch_size,
                 "decode_path": path, **against_research(dense, evicted, research)}  # fmt: skip
        rows.append(speed_row(name, selection.tau, dense, evicted, dense_s, evicted_s, **facts))
    return pd.DataFrame(rows, columns=DECODE_SPEED_COLUMNS)


def recorded_selections(
    table2: pd.DataFrame, table5: pd.DataFrame, decode: DecodeSplit, source: str = "the study"
) -> dict[str, RecordedSelection]:
    """Each gated cell's tau* as a study's tables froze it: the selection rule applied again to
    its validation sweep (table5's rows), checked against table2's ``tau_star``, bound to the
    swept model by table2's ``fingerprint``. A mismatch names the cell and ``source``."""
    missing = {"cell", "tau_star", "fingerprint"} - set(table2.columns)
    if missing:
        raise StudyError(
            f"{source}: table2 has no column {sorted(missing)} (a study written before the "
            "fingerprint was recorded); rerun the study"
        )
    out = {}
    if "text" in table2.columns:
        table2 = table2[table2["text"] == "test"]
    for _, row in table2.iterrows():
        cell = row["cell"]
        rule = TauRule.paper()  # studies written before the rule was recorded used the paper's
        if "tau_rule" in table2.columns:
            rule = TauRule(str(row["tau_rule"]), float(row["tau_rule_max_delta"]))
        sweep = table5[table5["cell"] == cell].sort_values("tau")
        if sweep.empty:
            raise StudyError(f"{source}: table5 has no validation sweep of {cell}")
        sel = RecordedSelection(
            str(row["fingerprint"]), decode, tuple(sweep["tau"].astype(float)),
            tuple(sweep["ppl"].astype(float)), tuple(sweep["compression"].astype(float)), rule,
        )  # fmt: skip
        if sel.tau != float(row["tau_star"]):
            raise StudyError(
                f"{source}: table2 gives {cell} tau* = {row['tau_star']}, but the rule on its "
                f"validation sweep in table5 selects {sel.tau}; the tables disagree"
            )
        out[cell] = sel
    return out


def check_fingerprints(
    cells: dict[str, TrainedCell], selections: dict[str, RecordedSelection], source: str
) -> None:
    """Each recorded tau* was selected on the model about to run, checked before any timed run
    (``evaluate_selected`` checks it again)."""
    for cell, sel in selections.items():
        have = model_fingerprint(cells[cell].model)
        if have != sel.fingerprint:
            raise StudyError(
                f"{source}: table2's tau* of {cell} was selected on another model (fingerprint "
                f"{sel.fingerprint}; the trained cell's is {have})"
            )


__all__ = [
    "DECODE_SPEED_COLUMNS",
    "against_research",
    "check_fingerprints",
    "decode_speed",
    "recorded_selections",
    "run_kinds",
    "speed_row",
    "spread",
    "time_decode",
]
