"""``torch.use_deterministic_algorithms`` scoped to a block of code, and the cuBLAS workspace that
deterministic matmuls need.

``train.deterministic`` turns the mode on for a whole run (``stabilitylab.train.build``); the
benchmarks time deterministic and default paths side by side in one process, so each path's mode
is set around its own calls and the previous one restored after. The Triton kernels read the mode
at launch: on, they launch their one pinned config (``kernels/sigmoid_attention.py``).
"""

from __future__ import annotations

import contextlib
import os

import torch

CUBLAS_WORKSPACE = ":4096:8"
"""A fixed cuBLAS workspace (8 buffers of 4 MiB, the default size on Hopper); deterministic
matmuls refuse to run without one."""


def set_cublas_workspace() -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` unless already set. CUDA reads it when it creates a cuBLAS
    handle, so call this before the process's first matmul."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """``torch.use_deterministic_algorithms(on)`` inside, the previous mode (and its warn-only
    flag) restored after, also on an error, so one path's mode never reaches another's timings."""
    before, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)
