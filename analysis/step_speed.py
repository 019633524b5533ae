"""How fast did runs train? Per run and arm: the median step time, throughput, MFU and peak memory
over the steps from ``--from-step`` on, and the whole run's wall time.

    python analysis/step_speed.py runs/kv_eager runs/kv_fast --from-step 50
    python analysis/step_speed.py runs/stress_8k --out /tmp/speed     # also step_speed.md / .csv

Each argument is a paired run dir, an arm dir, or a folder above them (as ``analysis/report.py``
takes them). The trainer logs its ``perf/`` tags every ``telemetry.log_every`` steps; the first
steps hold compiling (``train.fast``), autotuning and warm-up, so the medians start at
``--from-step`` (default 50). ``wall_s`` is summary.json's ``wall_time_s``: the whole run with its
compile and validation.

``paired``: for runs that trained the same cells in the same order (the same seed, global batch
and data; the lab's A/B runs and the two arms of one run), each step's time over the same step's
time of the baseline (``--baseline RUN`` or ``RUN/ARM``; default the table's first row), the
median over the steps both logged. A step that holds a recompile or a new kernel configuration
in one run only moves one ratio, where it can move a median over a few steps by several percent
(docs/LOG.md, 2026-12-03).

``stalls`` / ``stall_s``: the steps from ``--from-step`` on that took over ``STALL_FACTOR`` times
the arm's median, and the seconds they took beyond it: a recompile, a kernel autotuned at a new
length, a plan built (docs/BENCHMARKS.md, "Thirty steps at 8K"). The medians leave them out of
the speed; these columns say what they cost.

Exit code 2 with one ``error:`` line for a missing directory, one without event files, runs that
logged no ``perf/`` tag from that step on, or an unknown baseline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from stabilitylab import tags
from stabilitylab.analysis.cli import run_writer
from stabilitylab.analysis.events import discover, load_found, load_summary
from stabilitylab.analysis.markdown import table as markdown_table

SPEED_TAGS = {
    tags.STEP_TIME: "step_s",
    tags.TOKENS_PER_S: "tokens_per_s",
    tags.MFU: "mfu",
    tags.PEAK_MEM: "peak_mem_GiB",
}
"""The trainer's timing tags and their columns."""
STALL_FACTOR = 3.0
"""A step slower than this many times its arm's median step counts as a stall."""


def step_times(df: pd.DataFrame, from_step: int) -> pd.DataFrame:
    """The rows of tidy scalars ``df`` that hold a step time logged at ``from_step`` or later."""
    return df[(df["tag"] == tags.STEP_TIME) & (df["step"] >= from_step)]


def speed_table(df: pd.DataFrame, from_step: int) -> pd.DataFrame:
    """One row per (run, arm) of tidy scalars ``df``: ``steps`` (logged step times from
    ``from_step`` on) and the median of each tag of ``SPEED_TAGS`` over those steps (NaN for a
    tag the arm did not log: MFU and memory are CUDA-only). Raises ValueError when no arm logged
    a step time from ``from_step`` on."""
    times = step_times(df, from_step)
    if times.empty:
        raise ValueError(
            f"no {tags.STEP_TIME} logged at step >= {from_step} in these runs "
            "(shorter runs? lower --from-step)"
        )
    timed = df[df["tag"].isin(list(SPEED_TAGS)) & (df["step"] >= from_step)]
    wide = timed.pivot_table(index=["run", "arm"], columns="tag", values="value", aggfunc="median")
    counts = times.groupby(["run", "arm"])["step"].count()
    out = pd.DataFrame(index=wide.index)
    out["steps"] = counts.reindex(wide.index).fillna(0).astype(int)
    for tag, column in SPEED_TAGS.items():
        out[column] = wide[tag] if tag in wide else float("nan")
    return out.reset_index()


def paired_ratios(df: pd.DataFrame, from_step: int, baseline: tuple[str, str]) -> pd.Series:
    """Per (run, arm) of tidy scalars ``df``: the median over the steps from ``from_step`` on that
    it and ``baseline`` both logged of its step time over the baseline's (NaN where they share no
    step). Meaningful for runs that trained the same cells in the same order."""
    timed = step_times(df, from_step)
    times = timed.pivot_table(
        index="step", columns=["run", "arm"], values="value", aggfunc="median"
    )
    if baseline not in times.columns:
        known = ", ".join(f"{r}/{a}" for r, a in times.columns)
        raise ValueError(f"baseline {'/'.join(baseline)} logged no step time here; runs: {known}")
    return times.div(times[baseline], axis=0).median()


def stall_table(df: pd.DataFrame, from_step: int, factor: float = STALL_FACTOR) -> pd.DataFrame:
    """Per (run, arm) of tidy scalars ``df`` that logged a step time from ``from_step`` on:
    ``stalls``, the steps over ``factor`` times the arm's median step time, and ``stall_s``,
    their summed seconds beyond that median."""
    timed = step_times(df, from_step)
    median = timed.groupby(["run", "arm"])["value"].transform("median")
    stalled = timed["value"] > factor * median
    frame = pd.DataFrame(
        {"stalls": stalled, "stall_s": (timed["value"] - median).where(stalled, 0.0)}
    )
    keys = [timed["run"], timed["arm"]]
    return frame.groupby(keys).agg(stalls=("stalls", "sum"), stall_s=("stall_s", "sum"))


def resolve_baseline(table: pd.DataFrame, name: str | None) -> tuple[str, str]:
    """``RUN/ARM``, ``RUN`` (its first arm in the table) or None (the table's first row)."""
    rows = list(zip(table["run"], table["arm"], strict=True))
    if name is None:
        return rows[0]
    run, _, arm = name.partition("/")
    match = [(r, a) for r, a in rows if r == run and (not arm or a == arm)]
    if not match:
        known = ", ".join(f"{r}/{a}" for r, a in rows)
        raise ValueError(f"--baseline {name} is not among the runs read: {known}")
    return match[0]


def write_speed(
    paths: list[str], from_step: int, out: str | None, baseline: str | None = None
) -> dict[str, Path]:
    """Read the runs, add each arm's paired ratio to the baseline, its stalls and its wall time
    (None while a run is still going), write step_speed.md / .csv under ``out`` (default: the
    first run dir's ``step_speed/``)."""
    found = discover(paths)
    df = load_found(found)
    table = speed_table(df, from_step)
    base = resolve_baseline(table, baseline)
    ratios = paired_ratios(df, from_step, base)
    keys = list(zip(table["run"], table["arm"], strict=True))
    table["paired"] = [ratios.get(k) for k in keys]
    stalls = stall_table(df, from_step).reindex(keys, fill_value=0)  # an arm with no step time
    table["stalls"] = stalls["stalls"].astype(int).to_list()
    table["stall_s"] = stalls["stall_s"].astype(float).round(3).to_list()
    wall = {(run, arm): (load_summary(d) or {}).get("wall_time_s") for d, run, arm in found}
    table["wall_s"] = [wall.get(k) for k in keys]
    folder = Path(out) if out else Path(paths[0]) / "step_speed"
    folder.mkdir(parents=True, exist_ok=True)
    md = folder / "step_speed.md"
    md.write_text(
        f"Medians from step {from_step} on (`python analysis/step_speed.py`); `paired`: the median "
        f"over shared steps of each step's time over {base[0]}/{base[1]}'s.\n\n"
        + markdown_table(table)
        + "\n"
    )
    csv = folder / "step_speed.csv"
    table.to_csv(csv, index=False)
    return {"step_speed.md": md, "step_speed.csv": csv}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run dirs, arm dirs, or above")
    parser.add_argument("--from-step", type=int, default=50, help="first step of the medians")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/step_speed)")
    parser.add_argument(
        "--baseline", default=None, metavar="RUN[/ARM]", help="the paired column's reference"
    )
    args = parser.parse_args(argv)
    if args.from_step < 0:
        parser.error(f"--from-step must be >= 0, got {args.from_step}")
    return run_writer(
        lambda: write_speed(args.runs, args.from_step, args.out, args.baseline), "step_speed.md"
    )


if __name__ == "__main__":
    sys.exit(main())
