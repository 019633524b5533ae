"""What the three KV probe scripts share: their common flags, the trained cells and the windows
they read, and writing a family of tables (not a script itself)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from stabilitylab.eviction.cells import load_cells
from stabilitylab.probes.probe_text import cell_windows


def parser(doc: str, windows: int | None = None, cells_help: str = "every trained cell"):
    """The flags every probe script takes; a script adds its own to the parser returned."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--run", type=Path, required=True, help="a run dir holding cell dirs")
    p.add_argument("--out", type=Path, default=None, help="default: <run>/probes")
    p.add_argument("--cells", nargs="+", default=None, help=f"default: {cells_help}")
    p.add_argument("--split", default="test", choices=["val", "test"])
    p.add_argument(
        "--windows", type=int, default=windows,
        help="evaluation windows drawn evenly across the split (default: every full window)"
        if windows is None else f"evaluation windows drawn evenly across the split (default "
        f"{windows}, the paper's)",
    )  # fmt: skip
    p.add_argument(
        "--seed", type=int, default=0,
        help="seed of the draws: the windows' offset (probe_text.spread_indices) and any mask",
    )  # fmt: skip
    p.add_argument("--batch-size", type=int, default=16, help="windows per forward pass")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


@dataclass
class ProbeRun:
    out: Path
    models: dict[str, torch.nn.Module]
    tokens_BT: torch.Tensor
    lengths_B: torch.Tensor
    vocab: dict


def open_run(args: argparse.Namespace, gated_only: bool = False) -> ProbeRun:
    """The cells of ``--run`` (only the gated ones if asked) and ``--windows`` windows of
    ``--split`` drawn across it with ``--seed``."""
    cells = load_cells(args.run, args.cells, args.device)
    if gated_only:
        cells = {name: c for name, c in cells.items() if c.gated}
        if not cells:
            raise SystemExit(f"error: no gated cell among {args.cells or 'the cells'} under {args.run}")  # fmt: skip
    data_cfg = next(iter(cells.values())).config.data
    tokens_BT, lengths_B, vocab = cell_windows(
        args.run, list(cells), data_cfg, args.split, args.windows, args.seed
    )
    models = {name: c.model for name, c in cells.items()}
    return ProbeRun(args.out or args.run / "probes", models, tokens_BT, lengths_B, vocab)


def write_tables(tables: dict[str, pd.DataFrame], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, table in tables.items():
        table.to_csv(out / f"{name}.csv", index=False)
