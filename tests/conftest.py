"""Test-wide setup.

Without CUDA, Triton kernels run in its CPU interpreter. ``triton.jit`` chooses interpreter or
compiler when a kernel is defined, so the switch must be set before triton is imported: here,
before collection. On a GPU host it stays off (the compiled kernels are under test), and the
tests that need the interpreter (marked ``interpreter``, and the ``cpu`` cases of the kernel
tests) are skipped with the command that runs them: ``TRITON_INTERPRET=1 pytest -m "not gpu"``.
Tests marked ``exhaustive`` (long sweeps) are skipped unless ``--exhaustive`` is given or
``STABILITYLAB_EXHAUSTIVE=1`` is set, so that ``pytest -m gpu`` stays short.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from stabilitylab.kernels.triton_support import interpreter_available  # noqa: E402  (after it)


def needs_interpreter(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return "interpreter" in item.keywords or (
        callspec is not None and callspec.params.get("device") == "cpu"
    )


def pytest_addoption(parser):
    parser.addoption(
        "--exhaustive",
        action="store_true",
        help="also run the tests marked exhaustive (or set STABILITYLAB_EXHAUSTIVE=1)",
    )


def pytest_collection_modifyitems(config, items):
    exhaustive = (
        config.getoption("--exhaustive") or os.environ.get("STABILITYLAB_EXHAUSTIVE") == "1"
    )
    not_exhaustive = pytest.mark.skip(
        reason="exhaustive sweep: run with --exhaustive or STABILITYLAB_EXHAUSTIVE=1"
    )
    cuda, interpreter = torch.cuda.is_available(), interpreter_available()
    no_cuda = pytest.mark.skip(reason="needs CUDA")
    no_interpreter = pytest.mark.skip(
        reason="needs Triton's CPU interpreter, which needs TRITON_INTERPRET=1 before triton is "
        'imported: run TRITON_INTERPRET=1 pytest -m "not gpu"'
    )
    for item in items:
        if "exhaustive" in item.keywords and not exhaustive:
            item.add_marker(not_exhaustive)
        elif "gpu" in item.keywords and not cuda:
            item.add_marker(no_cuda)
        elif not interpreter and needs_interpreter(item):
            item.add_marker(no_interpreter)


@pytest.fixture
def one_thread():
    """Intra-op threads fight over a small shared CPU; one thread runs tiny models faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
