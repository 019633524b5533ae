"""The KV-eviction study's eviction tables over trained cells, as pandas DataFrames.

    cells = load_cells(run_dir, expect=cfg)
    inputs = study_inputs(cfg, cells)                    # val / test windows, decode split
    result = run_study(cells, inputs)                    # table1, table2, table5, decode_speed

- ``table1``: dense decode-window PPL on test of every cell (a gated cell at tau = 0, which
  evicts nothing), with the training's final validation PPL (summary.json; full-context
  forward, not the decode window).
- ``table5``: each gated cell's validation sweep over the tau grid: PPL, delta to its tau = 0,
  compression (all layers; evictable layers; per layer); the selected tau* flagged.
- ``table2``: each gated cell at its tau* (selected on validation by ``select_tau``, run on test
  only through ``evaluate_selected``): compression on val and test, test PPL, its dense backbone's
  test PPL (``sig-g-rope`` -> ``sig-rope``), and H2O / KeyDiff on that backbone at the budget
  matched per window and layer to the gated model's final live cache. A missing backbone leaves
  its columns NaN with a note. ``fingerprint`` names the swept model, so a later process can run
  the recorded tau* on that model only (``speed.recorded_selections``).
- ``decode_speed``: wall-clock of the test evaluation at tau* against the same model at tau = 0,
  median (min, max) of ``repeats`` alternating runs, decoded tokens per second, and the final
  live K/V bytes (``speed.py``); empty with ``timing=False`` (the parallel study's per-pair
  processes, whose parent times alone after them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd

from stabilitylab.config import Config, cell_settings
from stabilitylab.eviction.cells import (
    StudyError,
    TrainedCell,
    check_data,
    dense_backbone,
    eval_set,
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
    check_grid,
    evaluate,
    evaluate_baseline,
    evaluate_selected,
    matched_budget,
    select_tau,
    sweep_tau,
)
from stabilitylab.eviction.speed import DECODE_SPEED_COLUMNS, decode_speed
from stabilitylab.probes.probe_text import shared_vocab
from stabilitylab.train.task import open_text


@dataclass(frozen=True)
class StudyInputs:
    """What every evaluation of one study shares: the windows, the decode split, the grid."""

    val: EvalSet
    test: EvalSet
    decode: DecodeSplit
    val_windows: int | None
    """Validation windows of the sweep (None: all)."""
    test_windows: int | None
    batch_size: int
    grid: tuple[float, ...] = TAU_GRID
    progress: bool = False

    def val_kwargs(self) -> dict:
        return {"batch_size": self.batch_size, "max_windows": self.val_windows, "progress": self.progress}  # fmt: skip

    def test_kwargs(self) -> dict:
        return {"batch_size": self.batch_size, "max_windows": self.test_windows, "progress": self.progress}  # fmt: skip


def study_inputs(
    cfg: Config,
    cells: dict[str, TrainedCell],
    shards=None,
    grid=TAU_GRID,
    progress: bool = False,
) -> StudyInputs:
    """The study's windows in the cells' ids (``cfg.data``'s shards unless given), checked before
    any evaluation: the tau grid, the data the cells trained on, windows long enough."""
    grid = check_grid(grid)
    if not cells:
        raise StudyError("no cell to study")
    shards = shards if shards is not None else open_text(cfg.data)
    check_data(cells, shards)
    vocab = shared_vocab({c.name: c.vocab for c in cells.values()}, "study", StudyError)
    T = cfg.data.context_len
    decode = DecodeSplit(*cfg.study.decode_split(T))
    sets = {s: eval_set(shards, s, T, vocab) for s in (Split.VAL, Split.TEST)}
    for split in (Split.VAL, Split.TEST):
        if not sets[split].indices(decode):
            raise StudyError(
                f"no {split.value} window of {shards.path} holds study.prefill + study.window + 1 "
                f"= {decode.n_inputs + 1} tokens; shorten study.prefill / study.window"
            )
    s = cfg.study
    return StudyInputs(
        sets[Split.VAL], sets[Split.TEST], decode, s.val_windows or None, s.test_windows or None,
        s.batch_size, grid, progress,
    )  # fmt: skip


# ---- evaluations ------------------------------------------------------------------------------


@dataclass
class GatedOutcome:
    """One gated cell through the protocol: sweep, tau*, test, baselines on its backbone."""

    cell: str
    sweep: Sweep
    selection: Selection
    test: EvalResult
    """Test at tau* (``evaluate_selected``)."""
    backbone: str
    h2o: EvalResult | None = None
    keydiff: EvalResult | None = None
    note: str = ""


def dense_tests(cells: dict[str, TrainedCell], inputs: StudyInputs) -> dict[str, EvalResult]:
    """Every cell on test with nothing evicted (a gated cell's tau = 0)."""
    return {
        name: evaluate(c.model, inputs.test, NoEviction(), inputs.decode, **inputs.test_kwargs())
        for name, c in cells.items()
    }


def gated_outcome(cell: TrainedCell, cells: dict[str, TrainedCell], inputs: StudyInputs):
    """Sweep on validation, select tau*, run it on test, then the baselines on the backbone at
    the matched budget (when the backbone cell is among ``cells``)."""
    sweep = sweep_tau(cell.model, inputs.val, inputs.grid, inputs.decode, **inputs.val_kwargs())
    selection = select_tau(sweep)
    test = evaluate_selected(cell.model, inputs.test, selection, **inputs.test_kwargs())
    out = GatedOutcome(cell.name, sweep, selection, test, dense_backbone(cell.name))
    backbone = cells.get(out.backbone)
    if backbone is None:
        out.note = f"dense backbone {out.backbone} not trained: no baselines"
        return out
    budget = matched_budget(test)
    kw = {"batch_size": inputs.batch_size, "progress": inputs.progress}
    out.h2o = evaluate_baseline(backbone.model, inputs.test, H2O(), budget, **kw)
    out.keydiff = evaluate_baseline(backbone.model, inputs.test, KeyDiff(), budget, **kw)
    return out


# ---- tables -----------------------------------------------------------------------------------


def table1(cells: dict[str, TrainedCell], dense: dict[str, EvalResult]) -> pd.DataFrame:
    """Dense decode-window test PPL of every cell (gated ones at tau = 0)."""
    rows = []
    for name, c in cells.items():
        kind, gates, position = cell_settings(name)
        r = dense[name]
        rows.append(
            {
                "cell": name, "attention": kind, "gates": gates,
                "position": "rope" if position == "rope" else "nope",
                "test_ppl": r.ppl, "train_val_ppl": _float(c.summary.get("final_val_ppl")),
                "n_windows": len(r.window_indices), "n_targets": r.n_targets,
            }
        )  # fmt: skip
    return pd.DataFrame(rows)


def _float(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def table5(gated: dict[str, GatedOutcome]) -> pd.DataFrame:
    """The validation sweeps, one row per (gated cell, tau)."""
    frames = []
    for name, g in gated.items():
        df = pd.DataFrame(g.sweep.rows())
        df.insert(0, "cell", name)
        df["selected"] = df["tau"] == g.selection.tau
        frames.append(df)
    if not frames:
        return pd.DataFrame(columns=["cell", "tau", "ppl", "delta_ppl", "compression"])
    df = pd.concat(frames, ignore_index=True)
    per_layer = [c for c in df.columns if c.startswith("compression_L")]
    first = ["cell", "tau", "ppl", "delta_ppl", "compression", "compression_evictable"]
    rest = ["selected", "n_windows", "n_targets", "live_kv_bytes_per_window"]
    return df[first + per_layer + rest]


def table2(gated: dict[str, GatedOutcome], dense: dict[str, EvalResult]) -> pd.DataFrame:
    """Each gated cell at tau* on test against its dense backbone and the matched baselines."""
    rows = []
    for name, g in gated.items():
        val_at, val_0 = g.selection.val_result, g.sweep.results[g.sweep.taus.index(0.0)]
        own = dense[name].ppl
        base = dense[g.backbone].ppl if g.backbone in dense else math.nan
        row = {
            "cell": name, "backbone": g.backbone, "tau_star": g.selection.tau,
            "val_ppl_tau0": val_0.ppl, "val_ppl_tau_star": val_at.ppl,
            "val_compression": val_at.compression, "test_compression": g.test.compression,
            "test_compression_evictable": g.test.compression_evictable,
            "test_ppl_tau0": own, "test_ppl_tau_star": g.test.ppl,
            "delta_ppl_vs_tau0": g.test.ppl - own,
            "backbone_test_ppl": base, "delta_ppl_vs_backbone": g.test.ppl - base,
        }  # fmt: skip
        for key, r in (("h2o", g.h2o), ("keydiff", g.keydiff)):
            row[f"{key}_test_ppl"] = r.ppl if r is not None else math.nan
            row[f"{key}_delta_ppl"] = (r.ppl - base) if r is not None else math.nan
            row[f"{key}_compression"] = r.compression if r is not None else math.nan
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
    decode_speed: pd.DataFrame
    dense: dict[str, EvalResult] = field(default_factory=dict)
    """Test, nothing evicted, per cell."""
    gated: dict[str, GatedOutcome] = field(default_factory=dict)
    decode: DecodeSplit | None = None

    def tables(self) -> dict[str, pd.DataFrame]:
        return {
            "table1": self.table1,
            "table2": self.table2,
            "table5": self.table5,
            "decode_speed": self.decode_speed,
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
    dense = dense_tests(cells, inputs)
    gated = {n: gated_outcome(c, cells, inputs) for n, c in cells.items() if c.gated}
    speed = pd.DataFrame(columns=DECODE_SPEED_COLUMNS)
    if timing:
        selections = {n: g.selection for n, g in gated.items()}
        speed = decode_speed(cells, selections, inputs, repeats=repeats, alone=alone)
    return StudyResult(
        table1=table1(cells, dense), table2=table2(gated, dense), table5=table5(gated),
        decode_speed=speed, dense=dense, gated=gated, decode=inputs.decode,
    )  # fmt: skip


__all__ = [
    "DECODE_SPEED_COLUMNS",
    "GatedOutcome",
    "StudyInputs",
    "StudyResult",
    "decode_speed",
    "dense_tests",
    "gated_outcome",
    "run_study",
    "study_inputs",
    "table1",
    "table2",
    "table5",
]
