"""``experiments/stress_8k.py`` with the fast step compiled by the aot_eager backend, for the
multi-process tests (``tests/launch.py``): a launched process cannot take a monkeypatch."""

import sys

from stabilitylab.cli import train_main
from stabilitylab.train import fast

if __name__ == "__main__":
    fast.COMPILE_BACKEND = "aot_eager"
    sys.exit(train_main())
