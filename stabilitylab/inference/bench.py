"""The decode benchmark's grid, its bars and its command (``experiments/bench/bench_decode.py``);
what one cell of the grid measures and how: ``bench_steps.py``.

Rows: one per (model size, batch, context, compression, provider); ``provider`` engine at every
compression, sdpa and flex (where it runs) at 0. Bars (issue 40), as ratios from one run:
SDPA's dense step over the engine's (>= 1 everywhere); the engine's attention at 50% over dense
(<= 0.55 at 8K and above); tokens/s at 50% over dense (>= 1.3 at 32K, batch 32); the pages held
over the live entries' bytes (<= 1.05).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import pandas as pd
import torch

from stabilitylab.inference.bench_steps import (
    SIZES,
    BenchConfig,
    anchor_rows,
    engine_rows,
    random_model,
)

COLUMNS = [
    "size", "kind", "batch", "context", "compression", "provider", "step_ms", "attn_ms",
    "rest_ms", "tokens_per_s", "achieved_compression", "kv_held_bytes", "kv_live_bytes",
    "kv_dense_bytes", "kv_ratio", "device", "note",
]  # fmt: skip


# ---- the grid, the bars -----------------------------------------------------------------------


def _frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    df["rest_ms"] = df["step_ms"] - df["attn_ms"]
    df["tokens_per_s"] = df["batch"] / df["step_ms"] * 1e3
    return df


def run_grid(
    cfg: BenchConfig,
    log: Callable[[str], None] = print,
    partial: Callable[[pd.DataFrame], None] | None = None,
) -> pd.DataFrame:
    """Every (size, batch, context): the engine at every compression, then the anchors (after
    the engine's pool is freed: at 32K x 32 the paper's K/V is ~39 GB each). ``partial`` gets
    the rows so far after each (size, batch, context), so a run stopped midway keeps them."""
    rows = []
    dev = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed)
    gen_dev = torch.Generator(dev).manual_seed(cfg.seed)
    for size in cfg.sizes:
        model = random_model(size, cfg, max(cfg.contexts) + cfg.steps + 16)
        for B in cfg.batches:
            for N in cfg.contexts:
                base = {"size": size, "kind": cfg.kind, "batch": B, "context": N,
                        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}  # fmt: skip
                got = engine_rows(model, cfg, B, N, gen, gen_dev)
                gc.collect()  # the engine and its step graph refer to each other
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                if cfg.kind == "softmax":
                    got += anchor_rows(model, cfg, B, N, gen, gen_dev)
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                rows += [{**base, **r} for r in got]
                log(f"{size} B={B} N={N}: " + ", ".join(
                    f"{r['provider']}@{r['compression']:g} {r.get('step_ms', math.nan):.3f} ms"
                    for r in got))  # fmt: skip
                if partial is not None:
                    partial(_frame(rows))
    return _frame(rows)


def _bar(name, keys: dict, value: float, threshold: float, higher_is_better: bool) -> dict:
    if value != value:  # NaN: a provider that did not run
        status = "no data"
    else:
        status = (
            "met" if (value >= threshold if higher_is_better else value <= threshold) else "not met"
        )
    return {"bar": name, **keys, "value": value, "threshold": threshold, "status": status}


def _pick(g: pd.DataFrame, provider: str, col: str, c: float = 0.0) -> float:
    return g[(g["provider"] == provider) & (g["compression"] == c)][col].mean()


def bars(df: pd.DataFrame) -> pd.DataFrame:
    """Issue 40's bars, as ratios from this run (NaN stays NaN: ``no data``). The memory bar
    divides the pages held by the live entries' bytes, ``(1 - achieved compression) x dense``:
    what paging costs beyond the live cache."""
    out = []
    for (size, B, N), g in df.groupby(["size", "batch", "context"]):
        keys = {"size": size, "batch": B, "context": N}
        out.append(_bar("sdpa step / engine dense step", keys,
                        _pick(g, "sdpa", "step_ms") / _pick(g, "engine", "step_ms"), 1.0, True))  # fmt: skip
        if N >= 8192 and 0.5 in set(g["compression"]):
            ratio = _pick(g, "engine", "attn_ms", 0.5) / _pick(g, "engine", "attn_ms")
            out.append(_bar("engine attention at 50% / dense", keys, ratio, 0.55, False))
        if N >= 32768 and B >= 32 and 0.5 in set(g["compression"]):
            ratio = _pick(g, "engine", "tokens_per_s", 0.5) / _pick(g, "engine", "tokens_per_s")
            out.append(_bar("engine tokens/s at 50% / dense", keys, ratio, 1.3, True))
        for _, r in g[(g["provider"] == "engine") & (g["compression"] > 0)].iterrows():
            out.append(_bar(f"KV held / live at c = {r['compression']:g}", keys,
                            r["kv_held_bytes"] / r["kv_live_bytes"], 1.05, False))  # fmt: skip
    return pd.DataFrame(out)


def markdown(df: pd.DataFrame, cols: list[str] | None = None) -> str:
    from stabilitylab.analysis.markdown import table

    return table(df if cols is None else df[cols])


TABLE_COLUMNS = ["size", "batch", "context", "compression", "provider", "step_ms", "attn_ms",
                 "rest_ms", "tokens_per_s", "kv_ratio", "note"]  # fmt: skip


# ---- trained cells (--run) --------------------------------------------------------------------


def trained_cells(run_dir, device: str, repeats: int) -> pd.DataFrame:
    """A trained study's gated cells at table2's tau* against tau = 0, through the engine (the
    study's decode-speed table, ``eviction.speed.decode_speed``), on the study's test windows."""
    from pathlib import Path

    from stabilitylab.analysis.kv_study import read_study
    from stabilitylab.eviction.cells import StudyError, load_cells
    from stabilitylab.eviction.speed import check_fingerprints, decode_speed, recorded_selections
    from stabilitylab.eviction.study import study_inputs

    run_dir = Path(run_dir)
    tables = read_study(run_dir / "study")
    missing = [n for n in ("table2", "table5") if n not in tables]
    if missing:
        raise StudyError(f"{run_dir / 'study'}: no {missing}; write the study first")
    gated = list(tables["table2"]["cell"])
    if not gated:
        raise StudyError(f"{run_dir / 'study'}: table2 lists no gated cell")
    cells = load_cells(run_dir, gated, device)
    inputs = study_inputs(next(iter(cells.values())).config, cells)
    selections = recorded_selections(tables["table2"], tables["table5"], inputs.decode, str(run_dir))  # fmt: skip
    check_fingerprints(cells, selections, str(run_dir))
    return decode_speed(cells, selections, inputs, repeats=repeats, alone=True)


# ---- the command ------------------------------------------------------------------------------


def smoke_config(out_device: str = "cpu") -> BenchConfig:
    """Every code path on a CPU in seconds: a 2 x 32 decoder, context 48, batches 1 and 2,
    every compression, PyTorch attention (``--attention triton`` with TRITON_INTERPRET=1
    takes the kernel, slowly)."""
    return BenchConfig(
        sizes=["smoke"], contexts=[48], batches=[1, 2], steps=1, repeats=1, vocab=64,
        attention="reference", flex_contexts=[48], device=out_device, dtype=torch.float32,
    )  # fmt: skip


def parse(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Decode speed of the engine against SDPA / Flex.")
    p.add_argument("--smoke", action="store_true", help="CPU smoke run (seconds), every path")
    p.add_argument("--out", default="runs/bench_decode", help="output folder (CSV, markdown)")
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), help="model sizes")
    p.add_argument("--contexts", nargs="+", type=int, help="live context N before compression")
    p.add_argument("--compressions", nargs="+", type=float, help="fractions evicted, in [0, 1)")
    p.add_argument("--batches", nargs="+", type=int, help="batch sizes")
    p.add_argument("--kind", choices=["softmax", "sigmoid"], help="attention (sigmoid: no anchors)")
    p.add_argument("--no-gates", action="store_true", help="a model without gates")
    p.add_argument("--steps", type=int, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, help="repeats (the median is reported)")
    p.add_argument("--page-size", type=int, help="entries per page")
    p.add_argument("--attention", choices=["auto", "triton", "reference"])
    p.add_argument("--flex-contexts", nargs="*", type=int, help="contexts with a Flex anchor")
    p.add_argument("--run", help="a trained KV study's run dir: its gated cells at tau*")
    return p, p.parse_args(argv)


def config_from(args) -> BenchConfig:
    cfg = smoke_config() if args.smoke else BenchConfig()
    over = {"sizes": args.sizes, "contexts": args.contexts, "compressions": args.compressions,
            "batches": args.batches, "kind": args.kind, "steps": args.steps,
            "repeats": args.repeats, "page_size": args.page_size, "attention": args.attention,
            "flex_contexts": args.flex_contexts}  # fmt: skip
    for k, v in over.items():
        if v is not None:
            setattr(cfg, k, v)
    cfg.gates = cfg.gates and not args.no_gates
    return cfg


def check_config(cfg: BenchConfig) -> str | None:
    """The first problem with ``cfg``, or None."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device: run with --smoke on a CPU"
    if any(not 0 <= c < 1 for c in cfg.compressions):
        return f"--compressions must lie in [0, 1), got {cfg.compressions}"
    if any(n < 1 for n in [*cfg.contexts, *cfg.batches, cfg.steps, cfg.repeats, cfg.page_size]):
        return "--contexts, --batches, --steps, --repeats and --page-size must be >= 1"
    return None


def grid_parts(cfg: BenchConfig, out) -> list[str]:
    """The grid and its bars, written under ``out``; their markdown."""
    df = run_grid(cfg, partial=lambda part: part.to_csv(out / "decode.partial.csv", index=False))
    df.to_csv(out / "decode.csv", index=False)
    (out / "decode.partial.csv").unlink(missing_ok=True)
    bar = bars(df)
    bar.to_csv(out / "decode_bars.csv", index=False)
    return ["# Decode: engine vs SDPA / Flex", "", markdown(df, TABLE_COLUMNS), "",
            "## Bars", "", markdown(bar)]  # fmt: skip


def main(argv=None) -> int:
    """The command (``parse``). ``--run DIR`` alone times the trained cells only; with
    ``--sizes`` (or ``--smoke``) the grid runs first."""
    from pathlib import Path

    from stabilitylab.eviction.cells import StudyError
    from stabilitylab.runs import provenance, write_json

    _, args = parse(argv)
    cfg = config_from(args)
    if args.smoke:  # tiny models on a small shared CPU: one thread is several times faster
        torch.set_num_threads(1)
    problem = check_config(cfg)
    if args.run and not (Path(args.run) / "study" / "table2.csv").is_file():
        problem = problem or f"--run {args.run}: no study/table2.csv (write the study first)"
    if problem:
        print(f"error: {problem}")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = grid_parts(cfg, out) if not args.run or args.sizes or args.smoke else []
    if args.run:
        try:
            cells = trained_cells(args.run, cfg.device, cfg.repeats)
        except (StudyError, ValueError, FileNotFoundError) as e:
            print(f"error: {e}")
            return 2
        cells.to_csv(out / "cells.csv", index=False)
        parts += ["", "## Trained cells at tau*", "", markdown(cells)]
    (out / "decode.md").write_text("\n".join(parts).lstrip() + "\n")
    write_json(out / "provenance.json", {**provenance(), "config": {k: str(v) for k, v in vars(cfg).items()}})  # fmt: skip
    print("\n".join(parts))
    return 0
