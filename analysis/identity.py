"""Did two runs give the same curves bit for bit? Every arm, every scalar tag, every step.

    python analysis/identity.py runs/det_a runs/det_b               # -> runs/det_a/identity/
    python analysis/identity.py runs/det_a/softmax runs/det_b/softmax --out /tmp/identity

Each argument is a paired run dir (one arm dir per arm), an arm dir, or a folder above them, as
``analysis/report.py`` takes them. Arms are matched by name (config.json's ``arm``), or by their
path under the argument when one side holds two arms of one name. For every arm and every tag
logged by both runs: the number of steps each logged, the steps both logged (``n_common``), the
max |a - b| over those, how many differ and the first that does. A value equals another when
both are the same number, the same infinity, or both NaN (a run that diverged identically is
identical); a NaN or infinity against anything else counts as an infinite difference.

Verdict ``bit-identical`` when every compared tag of every arm has max |difference| exactly 0 on
the same steps. Nothing missing passes silently: a tag or an arm in one run only, or a tag
logged on other steps, makes the verdict ``not identical`` and has its row. Timing tags
(``perf/``: step time, throughput, MFU, peak memory) measure the machine, not the computation:
they keep their rows, marked ``timing``, and do not count in the verdict.

Event files store float32, so equal curves there are equal to float32 precision; the numbers of
summary.json that the trainer computes in float64 (initial and final loss, max grad norm, max
logit) are compared too, as tags ``summary/<key>`` at the run's last step. The config keys in
which the two arms differ (bookkeeping aside) are listed, so a comparison of two seeds says so.

Writes identity.md and identity.csv (one row per arm and tag) under ``--out``. Exit code 0
whether identical or not; 2 with one ``error:`` line for a missing directory or one without
event files.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from stabilitylab.analysis import markdown
from stabilitylab.analysis.cli import run_writer
from stabilitylab.analysis.events import (
    discover,
    load_config,
    load_found,
    load_summary,
)
from stabilitylab.analysis.settings import flatten

IDENTITY_FILES = ("identity.md", "identity.csv")
TIMING_PREFIXES = ("perf/",)
SUMMARY_KEYS = ("initial_loss", "final_loss", "max_grad_norm", "max_logit")
"""summary.json's float64 numbers that are a function of the computation (not wall time)."""
CONFIG_BOOKKEEPING = ("name", "out_dir", "fresh", "resume", "report", "trackers", "allow_cpu")
COLUMNS = [
    "arm", "tag", "status", "n_steps_a", "n_steps_b", "n_common", "max_abs_diff", "n_differ",
    "first_diff_step",
]  # fmt: skip
IDENTICAL, TIMING = "identical", "timing"
BIT_IDENTICAL, NOT_IDENTICAL = "bit-identical", "not identical"


def abs_differences(a_N: np.ndarray, b_N: np.ndarray) -> np.ndarray:
    """|a - b| elementwise, with 0 where both are the same value (same-sign infinities, both
    NaN) and inf where exactly one is non-finite or the infinities differ."""
    a_N, b_N = np.asarray(a_N, np.float64), np.asarray(b_N, np.float64)
    same = (a_N == b_N) | (np.isnan(a_N) & np.isnan(b_N))
    finite = np.isfinite(a_N) & np.isfinite(b_N)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.where(finite, np.abs(a_N - b_N), np.inf)
    return np.where(same, 0.0, diff)


def compare_series(steps_a, values_a, steps_b, values_b) -> dict:
    """One tag of one arm in runs A and B (``steps_*`` unique): step counts, common steps, max
    |difference| over them (NaN when none are common), differing count and first differing step,
    and the status: ``identical`` (same steps, every difference 0), ``steps differ`` or
    ``values differ``."""
    a = pd.Series(np.asarray(values_a, np.float64), index=np.asarray(steps_a, np.int64))
    b = pd.Series(np.asarray(values_b, np.float64), index=np.asarray(steps_b, np.int64))
    common = np.intersect1d(a.index.to_numpy(), b.index.to_numpy())
    diff_N = abs_differences(a.loc[common].to_numpy(), b.loc[common].to_numpy())
    differ = common[diff_N != 0]
    if len(differ):
        status = "values differ"
    elif len(common) == len(a) == len(b) and len(common):
        status = IDENTICAL
    else:
        status = "steps differ"
    return {
        "status": status,
        "n_steps_a": len(a),
        "n_steps_b": len(b),
        "n_common": len(common),
        "max_abs_diff": float(diff_N.max()) if len(common) else math.nan,
        "n_differ": len(differ),
        "first_diff_step": int(differ[0]) if len(differ) else None,
    }


def compare_arm(arm: str, df_a: pd.DataFrame, df_b: pd.DataFrame) -> pd.DataFrame:
    """Rows of ``COLUMNS`` for one arm: a tidy frame (tag, step, value) per run. A tag in one
    run only gets status ``only in A`` / ``only in B``; a ``perf/`` tag that would be identical
    or not gets status ``timing`` (kept, not judged)."""
    tags_a, tags_b = set(df_a["tag"]), set(df_b["tag"])
    rows = []
    for tag in sorted(tags_a | tags_b):
        if tag not in tags_b or tag not in tags_a:
            side, n = ("A", "n_steps_a") if tag in tags_a else ("B", "n_steps_b")
            df = df_a if side == "A" else df_b
            row = {"status": f"only in {side}", "n_steps_a": 0, "n_steps_b": 0, "n_common": 0,
                   "max_abs_diff": math.nan, "n_differ": 0, "first_diff_step": None}  # fmt: skip
            row[n] = int((df["tag"] == tag).sum())
        else:
            sa, sb = (d[d["tag"] == tag] for d in (df_a, df_b))
            row = compare_series(sa["step"], sa["value"], sb["step"], sb["value"])
            if tag.startswith(TIMING_PREFIXES):
                row["status"] = TIMING
        rows.append({"arm": arm, "tag": tag, **row})
    return pd.DataFrame(rows, columns=COLUMNS)


def summary_frame(summary: dict | None, last_step: int) -> pd.DataFrame:
    """summary.json's ``SUMMARY_KEYS`` as tidy rows ``summary/<key>`` at ``last_step``."""
    rows = [
        {"tag": f"summary/{k}", "step": last_step, "value": float(summary[k])}
        for k in SUMMARY_KEYS
        if summary and isinstance(summary.get(k), (int, float)) and summary[k] is not None
    ]
    return pd.DataFrame(rows, columns=["tag", "step", "value"])


def config_differences(config_a: dict | None, config_b: dict | None) -> list[str]:
    """Flattened config keys whose values differ (``key: a -> b``), bookkeeping aside."""
    if config_a is None or config_b is None:
        return [] if config_a is config_b else ["config.json: present in one run only"]
    fa, fb = flatten(config_a), flatten(config_b)
    out = []
    for k in sorted(set(fa) | set(fb)):
        if not k.startswith(CONFIG_BOOKKEEPING) and repr(fa.get(k)) != repr(fb.get(k)):
            out.append(f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}")
    return out


def arm_keys(found: list[tuple[Path, str, str]], root: Path) -> dict[str, Path]:
    """``{key: arm dir}``: the arm's name, or its path under ``root`` when a name repeats."""
    names = [arm for _, _, arm in found]
    if len(set(names)) == len(names):
        return {arm: d for d, _, arm in found}
    return {d.resolve().relative_to(root.resolve()).as_posix(): d for d, _, _ in found}


def arm_table(dir_a: Path, dir_b: Path, key: str) -> pd.DataFrame:
    """``compare_arm`` on two arm dirs: their event scalars and summary.json numbers."""
    frames = []
    for d in (dir_a, dir_b):
        df = load_found([(d, "run", key)])[["tag", "step", "value"]]
        last = int(df["step"].max()) if len(df) else 0
        frames.append(pd.concat([df, summary_frame(load_summary(d), last)], ignore_index=True))
    return compare_arm(key, *frames)


def compare_runs(run_a: str | Path, run_b: str | Path) -> tuple[pd.DataFrame, dict[str, list]]:
    """``(table, config differences per arm)`` for two runs; arms of one run only get one row,
    tag ``-``, status ``arm only in A`` / ``arm only in B``. Raises FileNotFoundError for a
    missing dir, ValueError for a dir without event files."""
    found_a, found_b = discover(run_a), discover(run_b)
    arms_a, arms_b = arm_keys(found_a, Path(run_a)), arm_keys(found_b, Path(run_b))
    tables, configs = [], {}
    for key in sorted(set(arms_a) | set(arms_b)):
        if key not in arms_a or key not in arms_b:
            side = "A" if key in arms_a else "B"
            row = {"arm": key, "tag": "-", "status": f"arm only in {side}"}
            tables.append(pd.DataFrame([row], columns=COLUMNS))
            continue
        tables.append(arm_table(arms_a[key], arms_b[key], key))
        configs[key] = config_differences(load_config(arms_a[key]), load_config(arms_b[key]))
    table = pd.concat(tables, ignore_index=True)
    return table.astype({"first_diff_step": "Int64"}), configs


def judged(table: pd.DataFrame) -> pd.DataFrame:
    """The rows that count in the verdict (timing tags aside)."""
    return table[table["status"] != TIMING]


def verdict(table: pd.DataFrame) -> str:
    """``bit-identical`` when every judged row is identical (and there is one), else not."""
    rows = judged(table)
    return BIT_IDENTICAL if len(rows) and (rows["status"] == IDENTICAL).all() else NOT_IDENTICAL


def arm_verdicts(table: pd.DataFrame) -> pd.DataFrame:
    """Per arm: its verdict, tags judged and identical, the fewest and most steps an event tag
    shares between the runs, the max |difference| over tags, and the timing tags left aside."""
    rows = []
    for arm, part in table.groupby("arm", sort=False):
        rows_j = judged(part)
        diffs = rows_j["max_abs_diff"].dropna()
        n_common = rows_j[~rows_j["tag"].str.startswith("summary/")]["n_common"].dropna()
        rows.append({
            "arm": arm, "verdict": verdict(part), "tags_judged": len(rows_j),
            "tags_identical": int((rows_j["status"] == IDENTICAL).sum()),
            "common_steps_min": int(n_common.min()) if len(n_common) else 0,
            "common_steps_max": int(n_common.max()) if len(n_common) else 0,
            "max_abs_diff": float(diffs.max()) if len(diffs) else math.nan,
            "timing_tags": int((part["status"] == TIMING).sum()),
        })  # fmt: skip
    return pd.DataFrame(rows)


def identity_markdown(table, configs, run_a, run_b, shown: int = 40) -> str:
    """identity.md: the verdict, the per-arm table, config differences, the rows that are not
    identical (the ``shown`` largest differences first; the CSV has every row)."""
    lines = [f"# Run identity: {verdict(table)}", "", f"- A: `{run_a}`", f"- B: `{run_b}`", ""]
    lines += [
        "Per arm: every tag logged by both runs (timing tags `perf/` aside) compared on the "
        "steps both logged; `bit-identical` when every max |difference| is exactly 0 on the "
        "same steps (NaN equals NaN). Event files hold float32; `summary/` tags are summary."
        "json's float64 numbers.",
        "",
        markdown.table(arm_verdicts(table)),
    ]
    differing = {arm: keys for arm, keys in configs.items() if keys}
    if differing:
        lines += ["", "## Config differences (A -> B)", ""]
        lines += [f"- `{arm}`: " + "; ".join(keys) for arm, keys in differing.items()]
    bad = judged(table)[judged(table)["status"] != IDENTICAL]
    if len(bad):
        bad = bad.sort_values("max_abs_diff", ascending=False, na_position="first")
        lines += ["", f"## Not identical ({len(bad)} rows; the first {min(shown, len(bad))})", ""]
        lines.append(markdown.table(bad.head(shown)))
    return "\n".join(lines) + "\n"


def write_identity(run_a, run_b, out: str | Path | None = None) -> dict[str, Path]:
    """Compare ``run_a`` and ``run_b``; write ``IDENTITY_FILES`` under ``out`` (default
    ``run_a/identity``); ``{file name: path}``."""
    table, configs = compare_runs(run_a, run_b)
    out = Path(out) if out is not None else Path(run_a) / "identity"
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in IDENTITY_FILES}
    table.to_csv(paths["identity.csv"], index=False)
    paths["identity.md"].write_text(identity_markdown(table, configs, run_a, run_b))
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", metavar="RUN_A", help="run dir, arm dir, or a folder above them")
    parser.add_argument("run_b", metavar="RUN_B", help="the run to compare with RUN_A")
    parser.add_argument("--out", default=None, help="output folder (default RUN_A/identity)")
    args = parser.parse_args(argv)
    return run_writer(lambda: write_identity(args.run_a, args.run_b, args.out), "identity.md")


if __name__ == "__main__":
    sys.exit(main())
