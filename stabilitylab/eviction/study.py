"""The KV-eviction study's eviction tables over trained cells, as pandas DataFrames.

    cells = load_cells(run_dir, expect=cfg)
    inputs = study_inputs(cfg, cells)                    # val / test windows, decode split, rule
    result = run_study(cells, inputs)                    # tables + every window's NLL

Every evaluation is kept per window (``windows``: text, cell, role, tau, window, NLL, keys read),
so each PPL difference the tables state gets a paired bootstrap interval
(``stabilitylab.analysis.kv_intervals.comparisons``, computed from ``windows`` alone so that
studies of disjoint cells merge). Texts: ``test`` (the training corpus's test split) and, with
``study.heldout_files`` / ``study.heldout_shards``, ``heldout`` (another corpus; tau* stays the
one frozen on the training corpus's validation split).

- ``table1``: per text, every cell with nothing evicted (a gated cell at tau = 0): PPL with its
  bootstrap interval, the training's final validation PPL (summary.json; full-context forward),
  dead gate layers from the training's summary.
- ``table5``: each gated cell's validation sweep over the tau grid (PPL, delta to its tau = 0,
  Delta ln PPL, compression all / evictable / per layer, keys read), ``accepted`` by the rule,
  ``selected`` tau*.
- ``sweep_test``: the same grid on test, reported beside tau* (it selects nothing).
- ``table2``: per text, each gated cell at tau* against its dense backbone and the baselines on
  that backbone (``study.baselines``: H2O and KeyDiff matched to the gate step by step, H2O at
  the same total spread evenly over layers, or the older final-size matching): PPL, compression
  and keys read as a fraction of the dense backbone's, for every policy.
- ``decode_speed``: wall-clock of the test evaluation at tau* against tau = 0 (``speed.py``);
  empty with ``timing=False``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from stabilitylab.analysis.intervals import ppl_interval
from stabilitylab.config import Config, cell_settings
from stabilitylab.eviction.cells import (
    StudyError,
    TrainedCell,
    check_data,
    dense_backbone,
    eval_set,
    heldout_set,
)
from stabilitylab.eviction.policies import H2O, KeyDiff, NoEviction
from stabilitylab.eviction.protocol import (
    TAU_GRID,
    DecodeSplit,
    EvalResult,
    EvalSet,
    Selection,
    Split,
    Sweep,
    TauRule,
    check_grid,
    evaluate,
    evaluate_baseline,
    evaluate_selected,
    matched_budget,
    select_tau,
    sweep_tau,
    test_sweep,
)
from stabilitylab.eviction.speed import DECODE_SPEED_COLUMNS, decode_speed
from stabilitylab.probes.probe_text import shared_vocab
from stabilitylab.train.task import open_text

BASELINES = {
    "h2o": (H2O(), "step"),
    "keydiff": (KeyDiff(), "step"),
    "h2o-even": (H2O(), "even"),
    "h2o-final": (H2O(), "final"),
    "keydiff-final": (KeyDiff(), "final"),
}
"""Baselines by name: the policy on the dense backbone and its budget mode (``Budget.mode``)."""
TEST, HELDOUT = "test", "heldout"


@dataclass(frozen=True)
class StudyInputs:
    """What every evaluation of one study shares: the windows, the decode split, the grid, the
    selection rule, the baselines."""

    val: EvalSet
    test: EvalSet
    decode: DecodeSplit
    val_windows: int | None
    """Validation windows of the sweep (None: all)."""
    test_windows: int | None
    batch_size: int
    grid: tuple[float, ...] = TAU_GRID
    progress: bool = False
    rule: TauRule = TauRule()
    baselines: tuple[str, ...] = ("h2o", "keydiff", "h2o-even")
    sweep_test: bool = True
    baseline_windows: int | None = None
    """Test windows the baselines run on, spread evenly over the split (None: all)."""
    n_boot: int = 2000
    heldout: EvalSet | None = None
    heldout_name: str = ""

    def val_kwargs(self) -> dict:
        return {"batch_size": self.batch_size, "max_windows": self.val_windows, "progress": self.progress}  # fmt: skip

    def test_kwargs(self) -> dict:
        return {"batch_size": self.batch_size, "max_windows": self.test_windows, "progress": self.progress}  # fmt: skip

    def texts(self) -> dict[str, EvalSet]:
        """The texts the cells are scored on with tau* frozen: test, and the held-out text."""
        out = {TEST: self.test}
        if self.heldout is not None:
            out[HELDOUT] = self.heldout
        return out


def study_inputs(
    cfg: Config,
    cells: dict[str, TrainedCell],
    shards=None,
    grid=TAU_GRID,
    progress: bool = False,
) -> StudyInputs:
    """The study's windows in the cells' ids (``cfg.data``'s shards unless given), checked before
    any evaluation: the tau grid, the data the cells trained on, windows long enough, the
    held-out text's vocabulary."""
    grid = check_grid(grid)
    if not cells:
        raise StudyError("no cell to study")
    shards = shards if shards is not None else open_text(cfg.data)
    check_data(cells, shards)
    vocab = shared_vocab({c.name: c.vocab for c in cells.values()}, "study", StudyError)
    T = cfg.data.context_len
    decode = DecodeSplit(*cfg.study.decode_split(T))
    sets = {s: eval_set(shards, s, T, vocab) for s in (Split.VAL, Split.TEST)}
    s = cfg.study
    heldout, heldout_name = heldout_set(s, T, vocab)
    for name, ev in [(sp.value, sets[sp]) for sp in (Split.VAL, Split.TEST)] + [
        (f"held-out ({heldout_name})", heldout)
    ]:
        if ev is not None and not ev.indices(decode):
            raise StudyError(
                f"no {name} window holds study.prefill + study.window + 1 = {decode.n_inputs + 1} "
                "tokens; shorten study.prefill / study.window"
            )
    rule = TauRule(s.tau_rule, s.max_delta_log_ppl if s.tau_rule == "relative" else s.max_delta_ppl)
    return StudyInputs(
        sets[Split.VAL], sets[Split.TEST], decode, s.val_windows or None, s.test_windows or None,
        s.batch_size, grid, progress, rule, tuple(s.baselines), s.test_sweep,
        s.baseline_windows or None, s.bootstrap, heldout, heldout_name,
    )  # fmt: skip


# ---- evaluations ------------------------------------------------------------------------------


@contextlib.contextmanager
def phase(what: str):
    """One line with the seconds a phase of the study took (a GPU budget is minutes:
    the log says where they went, with or without progress bars)."""
    start = time.perf_counter()
    yield
    print(f"study: {what} in {time.perf_counter() - start:.1f} s", flush=True)


@dataclass
class TextOutcome:
    """One gated cell on one text at its frozen tau*: the gate, the baselines, the grid."""

    gate: EvalResult
    baselines: dict[str, EvalResult] = field(default_factory=dict)
    sweep: Sweep | None = None


@dataclass
class GatedOutcome:
    """One gated cell through the protocol: sweep, tau*, then each text."""

    cell: str
    sweep: Sweep
    selection: Selection
    backbone: str
    texts: dict[str, TextOutcome] = field(default_factory=dict)
    note: str = ""

    @property
    def test(self) -> EvalResult:
        return self.texts[TEST].gate


def dense_results(cells: dict[str, TrainedCell], inputs: StudyInputs) -> dict[str, dict]:
    """Per text, every cell with nothing evicted (a gated cell's tau = 0)."""
    kw = inputs.test_kwargs()
    return {
        text: {n: evaluate(c.model, ev, NoEviction(), inputs.decode, **kw) for n, c in cells.items()}
        for text, ev in inputs.texts().items()
    }  # fmt: skip


def spread_indices(n: int, k: int | None) -> list[int]:
    """``k`` positions out of ``range(n)`` spread evenly (all when ``k`` is None or >= n)."""
    if k is None or k >= n:
        return list(range(n))
    return sorted({int(i) for i in np.linspace(0, n - 1, k).round()})


def subset(result: EvalResult, rows: list[int]) -> EvalResult:
    """``result`` restricted to some of its windows (rows into ``window_indices``)."""
    if len(rows) == len(result.window_indices):
        return result
    pick = np.asarray(rows)
    return dataclasses.replace(
        result,
        window_indices=tuple(result.window_indices[i] for i in rows),
        nll_N=result.nll_N[pick], n_targets=len(rows) * result.decode.window,
        live_NL=result.live_NL[pick], keys_read_NL=result.keys_read_NL[pick],
        live_NSL=None if result.live_NSL is None else result.live_NSL[pick],
    )  # fmt: skip


def text_outcome(cell, backbone, evalset, selection, inputs: StudyInputs, text: str):
    """The gate at tau* on one text (with its per-step live counts), the baselines on the
    backbone matched to it, and (test only) the reported grid."""
    kw = {"batch_size": inputs.batch_size, "progress": inputs.progress}
    windows = None if text != TEST else inputs.test_windows
    gate = evaluate_selected(
        cell.model, evalset, selection, max_windows=windows, record_steps=True, **kw
    )
    out = TextOutcome(gate)
    if backbone is not None and inputs.baselines:
        rows = spread_indices(len(gate.window_indices), inputs.baseline_windows)
        for name in inputs.baselines:
            policy, mode = BASELINES[name]
            budget = matched_budget(subset(gate, rows), mode)
            out.baselines[name] = evaluate_baseline(backbone.model, evalset, policy, budget, **kw)
    if text == TEST and inputs.sweep_test:
        out.sweep = test_sweep(cell.model, evalset, selection, max_windows=windows, **kw)
    out.gate = dataclasses.replace(gate, live_NSL=None)  # the budgets are built: free the counts
    return out


def gated_outcome(cell: TrainedCell, cells: dict[str, TrainedCell], inputs: StudyInputs):
    """Sweep on validation, select tau* by the rule, then on each text: the gate at tau*, the
    baselines on the backbone at the matched budget (when the backbone is among ``cells``)."""
    with phase(f"{cell.name}: validation sweep of {len(inputs.grid)} taus"):
        sweep = sweep_tau(cell.model, inputs.val, inputs.grid, inputs.decode, **inputs.val_kwargs())
    selection = select_tau(sweep, inputs.rule)
    out = GatedOutcome(cell.name, sweep, selection, dense_backbone(cell.name))
    backbone = cells.get(out.backbone)
    if backbone is None:
        out.note = f"dense backbone {out.backbone} not trained: no baselines"
    for text, ev in inputs.texts().items():
        with phase(f"{cell.name}: {text} at tau* {selection.tau:g} with baselines and grid"):
            out.texts[text] = text_outcome(cell, backbone, ev, selection, inputs, text)
    return out


# ---- per-window records -----------------------------------------------------------------------


def window_rows(text: str, cell: str, role: str, tau: float, r: EvalResult) -> pd.DataFrame:
    """One evaluation's windows: NLL sum, scored tokens, keys read and final live entries."""
    return pd.DataFrame(
        {
            "text": text, "cell": cell, "role": role, "tau": tau, "split": r.split.value,
            "policy": r.policy, "window": np.asarray(r.window_indices),
            "nll": r.nll_N, "tokens": r.decode.window,
            "keys_read": r.keys_read_NL.sum(1), "live": r.live_NL.sum(1),
        }
    )  # fmt: skip


def windows_table(dense: dict, gated: dict[str, GatedOutcome]) -> pd.DataFrame:
    """Every evaluation's per-window numbers. ``role``: ``dense`` (nothing evicted), ``tau_star``,
    ``sweep`` (a grid point; ``split`` val or test), or a baseline's name (``cell`` is then the
    gated cell whose budget it matched; it ran on that cell's backbone)."""
    frames = [
        window_rows(text, name, "dense", 0.0, r)
        for text, by_cell in dense.items()
        for name, r in by_cell.items()
    ]
    for name, g in gated.items():
        for t, r in zip(g.sweep.taus, g.sweep.results, strict=True):
            frames.append(window_rows("val", name, "sweep", t, r))
        for text, o in g.texts.items():
            frames.append(window_rows(text, name, "tau_star", g.selection.tau, o.gate))
            frames += [window_rows(text, name, b, math.nan, r) for b, r in o.baselines.items()]
            if o.sweep is not None:
                frames += [
                    window_rows(text, name, "sweep", t, r)
                    for t, r in zip(o.sweep.taus, o.sweep.results, strict=True)
                ]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


# ---- tables -----------------------------------------------------------------------------------


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _ppl_cols(r: EvalResult, n_boot: int, name: str = "ppl") -> dict:
    """``{name: PPL, name_lo, name_hi}``: the PPL and its bootstrap interval over windows."""
    iv = ppl_interval(r.nll_N, np.full(len(r.nll_N), r.decode.window), n_boot=n_boot)
    return {name: iv.estimate, f"{name}_lo": iv.lo, f"{name}_hi": iv.hi}


def table1(cells: dict[str, TrainedCell], dense: dict, inputs: StudyInputs) -> pd.DataFrame:
    """Per text, every cell with nothing evicted (gated ones at tau = 0): PPL and interval."""
    rows = []
    for text, by_cell in dense.items():
        for name, c in cells.items():
            kind, gates, position = cell_settings(name)
            r = by_cell[name]
            dead = c.summary.get("dead_gate_layers")
            rows.append(
                {
                    "text": text, "cell": name, "attention": kind, "gates": gates,
                    "position": "rope" if position == "rope" else "nope",
                    **_ppl_cols(r, inputs.n_boot, "test_ppl"),
                    "train_val_ppl": _float(c.summary.get("final_val_ppl")),
                    "dead_gate_layers": "" if not dead else " ".join(map(str, dead)),
                    "n_windows": len(r.window_indices), "n_targets": r.n_targets,
                }
            )  # fmt: skip
    return pd.DataFrame(rows)


def sweep_table(gated: dict[str, GatedOutcome], inputs: StudyInputs, test: bool) -> pd.DataFrame:
    """The validation sweeps (``table5``) or the test grids (``sweep_test``), one row per
    (gated cell, tau): PPL and interval, deltas to tau = 0, compression, keys read."""
    frames = []
    for name, g in gated.items():
        sweep = g.texts[TEST].sweep if test else g.sweep
        if sweep is None:
            continue
        ref = sweep.results[sweep.taus.index(0.0)].ppl
        rows = []
        for t, r in zip(sweep.taus, sweep.results, strict=True):
            ppl_cols = _ppl_cols(r, inputs.n_boot) if test else {"ppl": r.ppl}
            row = {"cell": name, "tau": t, **ppl_cols}
            row.update({k: v for k, v in r.row().items() if k not in ("ppl", "split", "budget")})
            row["delta_ppl"] = r.ppl - ref
            row["delta_log_ppl"] = (
                math.log(r.ppl) - math.log(ref) if r.ppl > 0 and ref > 0 else math.nan
            )
            if not test:
                row["accepted"] = inputs.rule.accepts(r.ppl, ref)
            row["selected"] = t == g.selection.tau
            rows.append(row)
        frames.append(pd.DataFrame(rows))
    if not frames:
        return pd.DataFrame(columns=["cell", "tau", "ppl", "delta_ppl", "compression"])
    df = pd.concat(frames, ignore_index=True)
    per_layer = [c for c in df.columns if c.startswith("compression_L")]
    first = [c for c in ("cell", "tau", "ppl", "ppl_lo", "ppl_hi", "delta_ppl", "delta_log_ppl",
                         "compression", "compression_evictable", "keys_read") if c in df.columns]  # fmt: skip
    rest = [c for c in ("accepted", "selected", "n_windows", "n_targets", "live_kv_bytes_per_window") if c in df.columns]  # fmt: skip
    return df[first + per_layer + rest]


def _policy_cols(key: str, r: EvalResult | None, dense_read: float, n_boot: int) -> dict:
    if r is None:
        return {f"{key}_test_ppl": math.nan, f"{key}_compression": math.nan,
                f"{key}_keys_read_frac": math.nan, f"{key}_windows": 0}  # fmt: skip
    return {
        **_ppl_cols(r, n_boot, f"{key}_test_ppl"), f"{key}_compression": r.compression,
        f"{key}_keys_read_frac": r.keys_read / dense_read if dense_read else math.nan,
        f"{key}_windows": len(r.window_indices),
    }  # fmt: skip


def table2(gated: dict[str, GatedOutcome], dense: dict, inputs: StudyInputs) -> pd.DataFrame:
    """Per text, each gated cell at tau* against its dense backbone and the baselines."""
    rows = []
    for text, by_cell in dense.items():
        for name, g in gated.items():
            o, own = g.texts[text], by_cell[name]
            base = by_cell.get(g.backbone)
            val_at, val_0 = g.selection.val_result, g.sweep.results[g.sweep.taus.index(0.0)]
            dense_read = float(base.keys_read) if base is not None else float(own.keys_read)
            row = {
                "text": text, "cell": name, "backbone": g.backbone, "tau_star": g.selection.tau,
                "tau_rule": inputs.rule.kind, "tau_rule_max_delta": inputs.rule.max_delta,
                "val_ppl_tau0": val_0.ppl,
                "val_ppl_tau_star": val_at.ppl, "val_compression": val_at.compression,
                "test_compression": o.gate.compression,
                "test_compression_evictable": o.gate.compression_evictable,
                "test_ppl_tau0": own.ppl, **_ppl_cols(o.gate, inputs.n_boot, "test_ppl_tau_star"),
                "gate_keys_read_frac": o.gate.keys_read / dense_read,
                "backbone_test_ppl": base.ppl if base is not None else math.nan,
            }  # fmt: skip
            for b in inputs.baselines:
                row.update(
                    _policy_cols(b.replace("-", "_"), o.baselines.get(b), dense_read, inputs.n_boot)
                )
            row["note"] = g.note
            row["fingerprint"] = g.selection.fingerprint  # binds tau* to the swept model
            rows.append(row)
    return pd.DataFrame(rows)


# ---- the whole study --------------------------------------------------------------------------


@dataclass
class StudyResult:
    table1: pd.DataFrame
    table2: pd.DataFrame
    table5: pd.DataFrame
    sweep_test: pd.DataFrame
    decode_speed: pd.DataFrame
    windows: pd.DataFrame
    dense: dict = field(default_factory=dict)
    """Per text, per cell: nothing evicted."""
    gated: dict[str, GatedOutcome] = field(default_factory=dict)
    decode: DecodeSplit | None = None

    def tables(self) -> dict[str, pd.DataFrame]:
        from stabilitylab.analysis.kv_intervals import comparisons

        return {
            "table1": self.table1,
            "table2": self.table2,
            "table5": self.table5,
            "sweep_test": self.sweep_test,
            "comparisons": comparisons(self.windows),
            "decode_speed": self.decode_speed,
            "windows": self.windows,
        }


def run_study(
    cells: dict[str, TrainedCell],
    inputs: StudyInputs,
    *,
    timing: bool = True,
    repeats: int = 3,
    alone: bool = True,
) -> StudyResult:
    """Every table of the eviction side over ``cells``. ``timing=False`` leaves decode_speed
    empty (no timed runs); ``repeats`` timed runs per gated cell; ``alone``: no other process of
    the study shares the device (decode_speed's ``measured_alone``)."""
    with phase(f"{len(cells)} cells with nothing evicted"):
        dense = dense_results(cells, inputs)
    gated = {n: gated_outcome(c, cells, inputs) for n, c in cells.items() if c.gated}
    speed = pd.DataFrame(columns=DECODE_SPEED_COLUMNS)
    if timing:
        selections = {n: g.selection for n, g in gated.items()}
        speed = decode_speed(cells, selections, inputs, repeats=repeats, alone=alone)
    return StudyResult(
        table1=table1(cells, dense, inputs), table2=table2(gated, dense, inputs),
        table5=sweep_table(gated, inputs, test=False), sweep_test=sweep_table(gated, inputs, test=True),
        decode_speed=speed, windows=windows_table(dense, gated), dense=dense, gated=gated,
        decode=inputs.decode,
    )  # fmt: skip


__all__ = [
    "BASELINES",
    "DECODE_SPEED_COLUMNS",
    "GatedOutcome",
    "StudyInputs",
    "StudyResult",
    "TextOutcome",
    "decode_speed",
    "dense_results",
    "gated_outcome",
    "run_study",
    "spread_indices",
    "study_inputs",
    "sweep_table",
    "table1",
    "table2",
    "windows_table",
]
