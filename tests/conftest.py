"""Test-wide setup.

Without CUDA, Triton kernels run in its CPU interpreter. ``triton.jit`` chooses interpreter or
compiler when a kernel is defined, so the switch must be set before any kernel module is imported:
here, before collection.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
