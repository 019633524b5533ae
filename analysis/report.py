"""Report over one or more runs: per-arm table, early-warning table, figures, tidy CSVs.

    python analysis/report.py runs/smoke            # paired run -> runs/smoke/report/
    python analysis/report.py runs/a/softmax runs/b --out /tmp/report

Writes report.md (its headline first: what ran, and what held, each arm's outcome), summary.csv
(one row per arm), early_warning.csv, scalars.csv (every scalar, tidy: run, arm, step, tag,
value), figure.png (loss / grad norm / layer-0 max logit, divergence marked) and heatmap.png
(per-layer max logit over steps, one panel per arm). Each diverged arm
gets its failure mechanism (``mechanism``: logit growth, early transient, other, unknown), and
report.md lists the early-transient failures apart from the rest. When the runs
hold repeats of an arm (same arm and setting; seeds pool, see ``rates``), report.md gives
outcome rates per arm (fraction diverged, 95% Wilson interval, divergence steps) and the early
warning over the repeats (lead, false-alarm rate on stable runs), also as rates.csv and
warning_rates.csv, with groups.png (the repeats pooled by group: loss, grad norm, max logit, an x
at each divergence); summary.csv gains a ``group`` column, and its first_warning leaves out any
precursor that fired on more than ``rates.FALSE_ALARM_MAX`` of the stable runs. Nothing missing
passes silently: an arm without an event file, or whose event files hold no scalar, keeps its
row (status from summary.json, else ``no data``) with a note; an event file cut mid-record is
named in report.md as well as in the printed warning; a missing tag leaves a panel empty with a
note in the figure and in report.md. Nor do arms that cannot be paired: when the arms of one
run were trained with configs that differ beyond the arm (``settings.arm_differences``: one arm
restarted alone with other values, ``--fresh=True --arm sigmoid --train.lr=...``), report.md says
so under "Arms that differ" and an ``ArmsDifferWarning`` is printed. Gated arms (the
KV-eviction study's) get a line each under "Dead gate layers": the gate layers summary.json lists
as dead (``dead_gate_layers``: mean gate below ``telemetry.dead_gate_below`` at the last logged
step), flagged, or none. Bad paths print one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import pandas as pd

from stabilitylab.analysis import markdown, plots
from stabilitylab.analysis import mechanism as mech
from stabilitylab.analysis import rates as rates_mod
from stabilitylab.analysis.cli import run_writer
from stabilitylab.analysis.events import (
    EVENT_GLOB,
    TruncatedEventsWarning,
    cut_message,
    discover,
    load_config,
    load_summary,
    read_found,
)
from stabilitylab.analysis.settings import arm_differences
from stabilitylab.analysis.stats import SUMMARY_COLUMNS, arm_row

REPORT_FILES = (
    "report.md", "summary.csv", "early_warning.csv", "scalars.csv", "figure.png", "heatmap.png",
)  # fmt: skip
BASIS_WORDS = {
    "arm": "stable runs of this group",
    "all stable runs": "stable runs of the report (this group has none)",
}
RATE_FILES = ("rates.csv", "warning_rates.csv", "groups.png")
"""Written as well when an arm was repeated (``rates``)."""
WARNING_COLUMNS = ["run", "arm", "precursor", "tag", "step", "divergence_step", "lead_steps"]
MECHANISM_COLUMNS = [
    "run", "arm", "group", "divergence_step", "mechanism", "logit_before_divergence",
    "logit_growth", "logit_lead_steps", "mechanism_detail",
]  # fmt: skip


def build_tables(
    df: pd.DataFrame,
    summaries: dict[tuple[str, str], dict | None],
    arms: list[tuple[str, str]] | None = None,
    configs: dict[tuple[str, str], dict | None] | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(summary table, early-warning table)`` for the arms ``arms`` (default: those in ``df``).

    An arm with no rows in ``df`` keeps a row: status from its summary, else ``no data``.
    ``configs``: each arm's config.json, for the warmup that the failure mechanism needs
    (``mechanism.classify``; without it the warmup is taken as 0 and the detail says so).
    """
    configs = configs or {}
    if arms is None:
        arms = list(df.groupby(["run", "arm"], sort=False).groups)
    rows, tables = [], []
    for run, arm in arms:
        df_arm = df[(df["run"] == run) & (df["arm"] == arm)]
        if df_arm.empty:
            summary = summaries.get((run, arm)) or {}
            rows.append({"run": run, "arm": arm, "status": summary.get("status", "no data")})
            continue
        row, warn = arm_row(df_arm, summaries.get((run, arm)), configs.get((run, arm)))
        rows.append(row)
        tables.append(warn)
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    summary = summary.astype(
        {"divergence_step": "Int64", "detected_step": "Int64", "lead_steps": "Int64",
         "logit_lead_steps": "Int64", "last_step": "Int64"}
    )  # fmt: skip
    # Rows, not pd.concat: a precursor column that is all-missing in one arm is not dropped.
    early = pd.DataFrame(
        [r for t in tables for r in t.to_dict("records")],
        columns=tables[0].columns if tables else None,
    )
    early = early.astype({"step": "Int64", "divergence_step": "Int64", "lead_steps": "Int64"})
    return summary, early


class ArmsDifferWarning(UserWarning):
    """The arms of one run were trained with configs that differ beyond the arm."""


def arm_difference_notes(found: list[tuple[Path, str, str]], configs: dict) -> list[str]:
    """One line per run (the folder that holds the arms) whose arms differ beyond the arm."""
    by_run: dict[Path, dict[str, dict | None]] = {}
    for d, run, arm in found:
        by_run.setdefault(Path(d).parent, {})[arm] = configs.get((run, arm))
    notes = []
    for run_dir, arm_configs in by_run.items():
        diff = arm_differences(arm_configs)
        if not diff:
            continue
        keys = "; ".join(
            f"{k}: " + ", ".join(f"{arm} {v!r}" for arm, v in values.items())
            for k, values in diff.items()
        )
        notes.append(
            f"`{run_dir}`: its arms were trained with different configs ({keys}), so comparing "
            "them compares more than the arm. `--fresh=True` restarts only the arms the command "
            "trains (with `--arm` one arm): rerun the others with the same values, or all arms "
            "with `--fresh=True`"
        )
    return notes


def data_notes(df: pd.DataFrame, found: list[tuple[Path, str, str]], cut: list[Path]) -> list[str]:
    """One line per arm without data and one for the event files cut mid-record."""
    notes = []
    present = set(map(tuple, df[["run", "arm"]].drop_duplicates().itertuples(index=False)))
    for d, run, arm in found:
        if (run, arm) in present:
            continue
        if not any(Path(d).glob(EVENT_GLOB)):
            notes.append(f"`{d}` (run `{run}`, arm `{arm}`): no event file; no curve, no numbers")
        else:
            notes.append(f"`{d}` (run `{run}`, arm `{arm}`): its event file(s) hold no scalar")
    if cut:
        notes.append(cut_message(cut))
    return notes


def write_report(run_dirs: list[str | Path], out_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the report files for ``run_dirs`` and return their paths.

    Keys are the file names in ``REPORT_FILES`` (``"report.md"``, ``"summary.csv"``,
    ``"early_warning.csv"``, ``"scalars.csv"``, ``"figure.png"``, ``"heatmap.png"``), and
    ``RATE_FILES`` when an arm was repeated.
    ``out_dir`` defaults to ``<first run dir>/report``. Raises
    FileNotFoundError / ValueError naming the path when a run dir is missing or no arm under the
    run dirs logged a scalar.
    """
    if isinstance(run_dirs, (str, Path)):
        run_dirs = [run_dirs]
    if not run_dirs:
        raise ValueError("no run directories given")
    found = discover(run_dirs, with_meta_only=True)
    df, cut = read_found(found)
    if cut:
        warnings.warn(cut_message(cut), TruncatedEventsWarning, stacklevel=2)
    if df.empty:
        raise ValueError(f"no scalars in the event files under {', '.join(map(str, run_dirs))}")
    summaries = {(run, arm): load_summary(d) for d, run, arm in found}
    configs = {(run, arm): load_config(d) for d, run, arm in found}
    steps = [(s or {}).get("steps") for s in summaries.values()]
    differ = arm_difference_notes(found, configs)
    for note in differ:
        warnings.warn(note.replace("`", ""), ArmsDifferWarning, stacklevel=2)

    out = Path(out_dir) if out_dir is not None else Path(run_dirs[0]) / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in REPORT_FILES}
    summary, early = build_tables(df, summaries, [(run, arm) for _, run, arm in found], configs)
    rates = repeat_tables(found, summary, early)
    if rates is not None:
        summary = rates["summary"]
        paths.update({name: out / name for name in RATE_FILES})
        rates["rates"].to_csv(paths["rates.csv"], index=False)
        rates["warning_rates"].to_csv(paths["warning_rates.csv"], index=False)
    divergence = {
        (r.run, r.arm): (None if pd.isna(r.divergence_step) else int(r.divergence_step))
        for r in summary.itertuples(index=False)
    }
    notes = plots.curves_figure(df, divergence, paths["figure.png"])
    notes += plots.logit_heatmap(df, paths["heatmap.png"])
    if rates is not None:
        keys = zip(summary["run"], summary["arm"], strict=True)
        groups = dict(zip(keys, summary["group"], strict=True))
        notes += plots.groups_figure(df, groups, divergence, paths["groups.png"])

    df.to_csv(paths["scalars.csv"], index=False)
    summary.to_csv(paths["summary.csv"], index=False)
    early.to_csv(paths["early_warning.csv"], index=False)
    missing = data_notes(df, found, cut)
    paths["report.md"].write_text(
        _markdown(
            summary,
            early,
            notes,
            found,
            missing,
            rates,
            differ,
            steps,
            dead_gate_lines(found, summaries),
        )  # fmt: skip
    )
    return paths


def dead_gate_lines(found: list[tuple[Path, str, str]], summaries: dict) -> list[str]:
    """One line per gated arm (its summary.json has ``dead_gate_layers``): the gate layers whose
    mean gate at the last logged step fell below ``telemetry.dead_gate_below``, flagged DEAD, or
    none; empty when no arm is gated."""
    lines = []
    for _, run, arm in found:
        s = summaries.get((run, arm)) or {}
        if "dead_gate_layers" not in s:
            continue
        dead, below = s["dead_gate_layers"], s.get("dead_gate_below")
        if dead is None:
            what = "no logged gate (telemetry.log_every=0): not checked"
        elif dead:
            means = s.get("gate_mean_layers") or []
            shown = ", ".join(
                f"{i} (mean {markdown.fmt(means[i])})" for i in dead if i < len(means)
            )
            what = f"**DEAD gate layers: {shown or dead}** (mean gate < {below:g})"
        else:
            what = f"none (every layer's mean gate >= {below:g})"
        lines.append(f"- `{run}` / `{arm}`: {what}")
    return lines


def repeat_tables(
    found: list[tuple[Path, str, str]], summary: pd.DataFrame, early: pd.DataFrame
) -> dict[str, pd.DataFrame] | None:
    """The tables of a report over repeats, or None when no arm was repeated (``rates``).

    Keys: ``summary`` (the per-run table with a ``group`` column and the first warning chosen
    without the precursors that false-alarm on stable runs), ``rates``, ``warning_rates``,
    ``settings``.
    """
    groups, settings = rates_mod.run_groups(found)
    if not rates_mod.has_repeats(groups):
        return None
    warn = rates_mod.warning_rates(early, summary, groups)
    summary = rates_mod.filter_first_warnings(summary, early, groups, warn)
    keys = zip(summary["run"], summary["arm"], strict=True)
    summary.insert(2, "group", [groups[k] for k in keys])
    return {
        "summary": summary,
        "rates": rates_mod.outcome_rates(summary, groups),
        "warning_rates": warn,
        "settings": settings,
    }


def _rates_markdown(tables: dict[str, pd.DataFrame]) -> list[str]:
    limit = rates_mod.FALSE_ALARM_MAX
    lines = [
        "",
        "## Outcome rates over repeats",
        "",
        "A group is one arm at one setting: runs whose resolved configs agree in every key "
        "but the seed, names and bookkeeping, so seeds pool and so do repeats of one seed. "
        "n_runs counts finished runs (stable or diverged); the interval is the 95% Wilson "
        "interval of the fraction diverged; diverged counts the failures per mechanism (see "
        "Failure mechanisms). first_warning: the precursor named first most often on the "
        "group's diverged runs.",
        "",
        markdown.table(tables["rates"]),
    ]
    if len(tables["settings"].columns) > 1:
        lines += ["", "Settings (the config keys the groups differ in):", ""]
        lines.append(markdown.table(tables["settings"]))
    lines += [
        "",
        "## Early warning over repeats",
        "",
        "Per group and precursor, over the runs with its data: n_warned of n_diverged runs "
        "warned at or before the divergence, with the lead in steps (median, min, max over "
        "those); n_false_alarm of n_stable runs where it fired at all, with the 95% Wilson "
        "interval. false_alarm_basis: the stable runs judged on (`arm`: the group's own; "
        "`all stable runs`: the report's, where the group has none; `-`: none at all). "
        f"A precursor with a false-alarm rate above {limit:.0%} is not named in the "
        "first_warning columns (`named` false): it fires whether or not a run diverges.",
        "",
        markdown.table(tables["warning_rates"]),
    ]
    skipped = tables["warning_rates"][~tables["warning_rates"]["named"]]
    if not skipped.empty:
        lines += ["", "Not named as first warning:", ""]
        lines += [
            f"- `{r.precursor}` for `{r.group}`: fired on {r.n_false_alarm} of {r.n_stable} "
            f"{BASIS_WORDS[r.false_alarm_basis]}, {r.false_alarm_rate:.0%} > {limit:.0%}"
            for r in skipped.itertuples(index=False)
        ]
    return lines


def _mechanism_markdown(summary: pd.DataFrame) -> list[str]:
    """Every failure with its mechanism, then the early transients apart: a failure of the
    optimizer's start, not of the logit growth the study is about (``mechanism``)."""
    failed = summary[summary["mechanism"].isin(mech.FAILURES)]
    if failed.empty:
        return []
    lines = [
        "",
        "## Failure mechanisms",
        "",
        "What each diverged arm's max attention logit did up to its divergence step "
        f"(`mechanism.classify`). **logit growth**: the max of its last {mech.N_BEFORE} logged "
        f"points at or before the divergence is at least {mech.GROWTH_MIN:g}x its first logged "
        f"value and at least {mech.LOGIT_MIN:g} (the paper's mechanism: logits grow, then the "
        "grad norm explodes). **early transient**: no such growth, and it diverged at or before "
        f"step warmup + {mech.EARLY_STEPS} (Adam's start with no or a short warmup). **other**: "
        "no such growth, later. **unknown**: no finite max logit logged before the divergence. "
        "logit_before_divergence and logit_growth are those last points and their ratio to the "
        f"first; logit_lead_steps = divergence step - the first step the logit reached "
        f"{mech.LOGIT_MIN:g}.",
        "",
        markdown.table(failed[[c for c in MECHANISM_COLUMNS if c in failed.columns]]),
        "",
        "### Early-transient failures (not the logit-growth mechanism)",
        "",
    ]
    early = failed[failed["mechanism"] == mech.EARLY_TRANSIENT]
    if early.empty:
        return [*lines, "None."]
    return lines + [
        f"- `{r.run}` / `{r.arm}` ({markdown.fmt(r.divergence_reason)}): {r.mechanism_detail}"
        for r in early.itertuples(index=False)
    ]


HEADLINE_ARMS = 4
"""Up to this many arms, the headline names each one's outcome; beyond, it counts them."""


def _outcome(row, with_run: bool) -> str:
    """``softmax diverged at step 665 (logit growth)``, ``sigmoid stable``."""
    who = f"{row.arm} (`{row.run}`)" if with_run else str(row.arm)
    text = f"{who} {row.status}"
    if row.status == "diverged" and not pd.isna(row.divergence_step):
        text += f" at step {int(row.divergence_step)}"
        if isinstance(row.mechanism, str):
            text += f" ({row.mechanism})"
    return text


def _span(values) -> str:
    """``300`` or ``120-300``; "" for none."""
    values = [int(v) for v in values if v is not None and not pd.isna(v)]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def headline(summary: pd.DataFrame, steps=()) -> list[str]:
    """The report's first lines: what ran (arms, runs, their steps) and what held: each arm's
    outcome; beyond ``HEADLINE_ARMS`` arms, the count per outcome and the arms that did not stay
    stable (arms of distinct names), or the count per arm name and outcome (repeats). ``steps``:
    each arm's steps from summary.json; without them, the last logged step."""
    runs = list(dict.fromkeys(summary["run"]))
    n = len(summary)
    named = ", ".join(f"`{r}`" for r in runs[:3]) + (", ..." if len(runs) > 3 else "")
    ran = f"**Ran:** {n} arm{'s' * (n != 1)} of {len(runs)} run{'s' * (len(runs) != 1)} ({named})"
    if _span(steps):
        every = sum(v is not None for v in steps) == n > 1 and "-" not in _span(steps)
        ran += f", {_span(steps)} steps{' each' * every}."
    elif _span(summary["last_step"]):
        ran += f", logged to step {_span(summary['last_step'])}."
    else:
        ran += "."
    if n <= HEADLINE_ARMS:
        held = "; ".join(_outcome(r, len(runs) > 1) for r in summary.itertuples(index=False))
    elif summary["arm"].is_unique:  # e.g. the KV study's cells: the count, then what did not hold
        counts = summary["status"].value_counts(sort=False)
        held = ", ".join(f"{k} {status}" for status, k in counts.items())
        rows = [r for r in summary.itertuples(index=False) if r.status != "stable"]
        held += (": " + "; ".join(_outcome(r, False) for r in rows)) if rows else ""
    else:
        counts = summary.groupby(["arm", "status"], sort=False).size()
        held = "; ".join(
            f"{arm}: " + ", ".join(f"{k} {status}" for status, k in by.droplevel(0).items())
            for arm, by in counts.groupby(level=0, sort=False)
        )
    return [ran, f"**Held:** {held}."]


def _markdown(
    summary, early, notes, found, missing, rates=None, differ=(), steps=(), dead_gates=()
) -> str:
    ran, held = headline(summary, steps)
    lines = ["# Stability report", "", ran, "", held, "", "Runs:"]
    lines += [f"- `{d}` (run `{run}`, arm `{arm}`)" for d, run, arm in found]
    if differ:
        lines += ["", "## Arms that differ", "", *[f"- {m}" for m in differ]]
    if missing:
        lines += ["", "## Missing or cut data", "", *[f"- {m}" for m in missing]]
    if dead_gates:
        lines += [
            "", "## Dead gate layers", "",
            "Gated arms: the gate layers (numbered as `gate/mean/layer_{i}`, the layer that emits "
            "the gate) whose mean gate at the last logged training step is below "
            "`telemetry.dead_gate_below`: the next layer's attention is switched off there.",
            "", *dead_gates,
        ]  # fmt: skip
    if rates is not None:
        lines += _rates_markdown(rates)
    lines += _mechanism_markdown(summary)
    lines += [
        "",
        "## Per arm",
        "",
        "Max and growth (= max / median of the first 10 logged points) are over the logged "
        "points, so they can sit below summary.json's every-step maxima. Status and divergence "
        "step from summary.json when present; detected_step = `detectors.diverged` on the "
        "logged loss and grad norm. mechanism and the logit_* columns: `mechanism.classify` "
        "(Failure mechanisms above, when an arm diverged; the detail is in summary.csv)."
        + (
            " first_warning leaves out the precursors not named above." if rates is not None else ""
        ),
        "",
        markdown.table(summary.drop(columns=["mechanism_detail"])),
        "",
        "## Early warning",
        "",
        "Step at which each precursor detector first fired; lead = divergence step - that step "
        "(negative: after the divergence; `-`: never fired, or no divergence). On a stable arm "
        "any firing is a false alarm.",
        "",
    ]
    if early.empty:
        lines.append("No precursor had data.")
    else:
        lines.append(markdown.table(early[WARNING_COLUMNS]))
    lines += ["", "## Figures", ""]
    if rates is not None:
        lines += ["![repeats by group](groups.png)", ""]
    lines += ["![curves](figure.png)", "", "![max logit](heatmap.png)", ""]
    if notes:
        lines += ["Notes:", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="arm dir or paired run dir")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    return run_writer(lambda: write_report(args.run_dirs, args.out), "report.md")


if __name__ == "__main__":
    sys.exit(main())
