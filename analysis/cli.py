"""The shared tail of the analysis scripts' ``main``: one-line warnings, a clear error for bad
paths or data (exit code 2), then the main file printed and the paths written."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path


def one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def run_writer(write: Callable[[], dict[str, Path]], main_file: str) -> int:
    """Call ``write`` (returns ``{file name: path}``); print ``main_file``'s text and the paths."""
    with warnings.catch_warnings():
        warnings.showwarning = one_line_warning
        try:
            paths = write()
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(paths[main_file].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0
