"""Session 12: the concurrent-backward test must fail when the caller's stream does not wait for
the side stream (the join removed); run in-process so the patch reaches the test's module."""
import contextlib, sys
import pytest, torch
import stabilitylab.kernels.sigmoid_attention as sa

@contextlib.contextmanager
def no_join(device, enabled=True):
    if not enabled:
        yield
        return
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        yield

sa.side_stream = no_join
rc = pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:benchmark", "-m", "gpu", "-k", "concurrent_backward", "tests/test_kernels.py"])
print("planted no-join: pytest rc", rc, "(1 = the test caught it)")
sys.exit(0 if rc == 1 else 1)
