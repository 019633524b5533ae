"""Rebuild a benchmark's CSV and tables from its log (call 1 brought back only 8 files; the hd-64
CSV and the model-step CSV stayed on the device). TFLOPS to 0.1 as printed; ms are not in the log.

    PYTHONPATH=. python3 results/bench/h200-2026-11-30-s10/scripts/from_log.py
"""

import re
import sys
from pathlib import Path

import pandas as pd

from stabilitylab.kernels.bench_report import (
    bars,
    bars_markdown,
    markdown_table,
    model_step_bar,
    summary,
)

HERE = Path(__file__).resolve().parents[1] / "call1_table"
ROW = re.compile(
    r"^(\S+)\s+D=\s*(\d+) T=\s*(\d+) pad=([\d.]+) round (\d+) fwd\s+(\S+) bwd\s+(\S+) TFLOPS$"
)
STEP = re.compile(r"^model step (\S+)\s+mb=(\d+) round (\d+): ([\d.]+) ms$")


def attention(log: Path) -> pd.DataFrame:
    rows = [m.groups() for line in log.read_text().splitlines() if (m := ROW.match(line))]
    df = pd.DataFrame(rows, columns="provider D T pad round fwd_tflops bwd_tflops".split())
    return df.astype({"D": int, "T": int, "pad": float, "round": int,
                      "fwd_tflops": float, "bwd_tflops": float})  # fmt: skip


def main() -> None:
    head = (HERE / "bench64.log").read_text().splitlines()[0]
    for D in (64, 128):
        df = attention(HERE / f"bench{D}.log")
        out = HERE / f"bench{D}"
        df.to_csv(out / "attention_from_log.csv", index=False)
        (out / "attention_from_log.md").write_text(f"{head}\n\n{markdown_table(summary(df))}\n")
        (out / "bars_from_log.md").write_text(f"{head}, 3 rounds\n\n{bars_markdown(bars(df))}\n")
    both = pd.concat([attention(HERE / f"bench{D}.log") for D in (64, 128)])
    (HERE / "bars_from_log.md").write_text(f"{head}, 3 rounds\n\n{bars_markdown(bars(both))}\n")
    steps = [m.groups() for line in (HERE / "model_step.log").read_text().splitlines()
             if (m := STEP.match(line))]  # fmt: skip
    ms = pd.DataFrame(steps, columns="backend micro_batch round step_ms".split())
    ms = ms.astype({"micro_batch": int, "round": int, "step_ms": float})
    ms.to_csv(HERE / "model_step" / "model_step_from_log.csv", index=False)
    (HERE / "model_step" / "model_step_from_log.md").write_text(
        f"{head}\n\n{markdown_table(model_step_bar(ms))}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
