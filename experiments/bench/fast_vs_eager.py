"""The fast step (train.fast) against the eager one: the same loss curve over 200 steps of the
smoke and proxy presets, both arms, on one GPU; or of KV-eviction cells (their gated decoder).

    python experiments/bench/fast_vs_eager.py                  # -> runs/bench/fast_vs_eager
    python experiments/bench/fast_vs_eager.py --presets reduced --cells sig-g-rope sm-g-rope \
        --steps 100 --out runs/bench/fast_vs_eager_kv     # needs `make data`

Each (preset, run) trains in a process of its own, all at once (compiles use their own CPU
cores): eager, fast, and two noise yardsticks for the eager curve: eager again (SDPA's backward
and atomics differ run to run on a GPU; a bit-reproducible arm repeats exactly) and eager with
half the micro-batch (the same function and data, summed in another order: what rounding alone
moves, also for an arm that repeats bit for bit). Dropout 0: inductor draws dropout from its own
RNG, another sample. Writes ``fast_vs_eager.md`` / ``.json``: per preset and arm, eager's and
fast's final loss, the max |difference| and the mean |difference| over the last 50 steps
relative to eager's loss (``stabilitylab.analysis.curves``), the same for each yardstick, each
run's training time (fast's holds its compile) and the fast path's mode as it printed it.
Expected: the fast curve within bf16 noise of eager, i.e. a tail gap of the order of the larger
yardstick's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from stabilitylab.analysis.curves import curve_gap
from stabilitylab.presets import KV_PRESETS, PRESETS
from stabilitylab.train.checkpoint import read_state

ROOT = Path(__file__).resolve().parents[2]
RUNS = ("eager", "fast", "eager_again", "eager_split")
YARDSTICKS = ("eager_again", "eager_split")


def run_overrides(preset: str, kind: str) -> list[str]:
    """The overrides of one kind of run (``RUNS``): the fast step for ``fast``; the eager step
    with half the preset's micro-batch (the same global batch) for ``eager_split``."""
    if kind not in RUNS:
        raise ValueError(f"unknown run kind {kind!r}; choose from {RUNS}")
    if kind == "fast":
        return ["--train.fast=True"]
    if kind != "eager_split":
        return ["--train.fast=False"]
    micro = PRESETS[preset]().train.micro_batch
    if micro < 2:
        raise ValueError(f"preset {preset!r} has micro_batch {micro}: nothing to split")
    return ["--train.fast=False", f"--train.micro_batch={micro // 2}"]


def run_command(preset: str, kind: str, steps: int, out: Path, cells: list[str]) -> list[str]:
    """The training command of one run: ``stress_8k.py`` for the stress presets (both arms),
    ``kv_eviction.py`` with ``cells`` for the KV presets; dropout 0, no report."""
    kv = preset in KV_PRESETS
    script = ROOT / "experiments" / ("kv_eviction.py" if kv else "stress_8k.py")
    return [
        sys.executable, str(script), "--preset", preset, *(["--cells", *cells] if kv else []),
        f"--name={preset}_{kind}", f"--out_dir={out / 'runs'}", "--fresh=True", "--report=False",
        f"--train.steps={steps}", "--model.dropout=0", *run_overrides(preset, kind),
    ]  # fmt: skip


def arms_of(preset: str, cells: list[str]) -> list[str]:
    """The runs' arms: a KV preset's cells, else the paired stress run's two arms."""
    return list(cells) if preset in KV_PRESETS else ["softmax", "sigmoid"]


def launch(preset: str, kind: str, steps: int, out: Path, cells: list[str]) -> subprocess.Popen:
    log = open(out / f"{preset}_{kind}.log", "w")  # noqa: SIM115  (closed with the process)
    cmd = run_command(preset, kind, steps, out, cells)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def arm_history(out: Path, preset: str, kind: str, arm: str) -> dict:
    return read_state(out / "runs" / f"{preset}_{kind}" / arm / "checkpoints" / "last")["history"]


def fast_mode(out: Path, preset: str) -> list[str]:
    """The fast path's own lines from the fast run's log (its mode, any fallback and why)."""
    text = (out / f"{preset}_fast.log").read_text(errors="replace")
    return sorted({ln.strip() for ln in text.splitlines() if ln.startswith("fast path")})


def compare(out: Path, presets: list[str], cells: list[str]) -> list[dict]:
    rows = []
    for preset in presets:
        for arm in arms_of(preset, cells):
            h = {k: arm_history(out, preset, k, arm) for k in RUNS}
            rows.append({
                "preset": preset, "arm": arm,
                **{k: curve_gap(h["eager"]["loss"], h[k]["loss"]) for k in ("fast", *YARDSTICKS)},
                "wall_s": {k: h[k]["wall_time_s"] for k in RUNS},
                "fast_path": fast_mode(out, preset),
            })  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| preset | arm | eager final | fast final | fast max abs | fast tail rel | "
        "eager-again tail rel | eager-split tail rel | wall s eager / fast |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f, a, b = r["fast"], r["eager_again"], r["eager_split"]
        lines.append(
            f"| {r['preset']} | {r['arm']} | {f['final_reference']:.4f} | {f['final_other']:.4f} "
            f"| {f['max_abs']:.3g} | {f['tail_rel']:.2e} | {a['tail_rel']:.2e} "
            f"| {b['tail_rel']:.2e} | {r['wall_s']['eager']:.0f} / {r['wall_s']['fast']:.0f} |"
        )
    modes = {m for r in rows for m in r["fast_path"]}
    return "\n".join([*lines, "", *sorted(modes)]) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/bench/fast_vs_eager"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--presets", nargs="+", default=["smoke", "proxy"])
    p.add_argument(
        "--cells", nargs="+", default=["sig-g-rope", "sm-g-rope"],
        help="the KV presets' cells (the gated ones take the key bias through the kernels)",
    )  # fmt: skip
    args = p.parse_args()
    unknown = [pr for pr in args.presets if pr not in PRESETS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; choose from {sorted(PRESETS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    procs = {
        (pr, k): launch(pr, k, args.steps, args.out, args.cells)
        for pr in args.presets
        for k in RUNS
    }
    failed = [f"{pr}/{k}" for (pr, k), proc in procs.items() if proc.wait() != 0]
    if failed:
        print(f"error: runs failed: {failed} (logs in {args.out})", file=sys.stderr)
        return 1
    rows = compare(args.out, args.presets, args.cells)
    (args.out / "fast_vs_eager.json").write_text(json.dumps(rows, indent=2))
    (args.out / "fast_vs_eager.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
