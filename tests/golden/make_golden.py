"""Regenerate the golden smoke loss curve: python tests/golden/make_golden.py

Then check it as tests/golden/README.md says (pytest tests/test_golden.py)."""

import json
import tempfile
from pathlib import Path

import torch

from stabilitylab.config import parse
from stabilitylab.train import run
from stabilitylab.train.checkpoint import read_state

STEPS = 30

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse(
            [
                "--preset",
                "smoke",
                "--arm=softmax",
                f"--out_dir={tmp}",
                "--report=False",
                "--telemetry.probe_every=0",
                f"--train.steps={STEPS}",
            ]
        )
        run(cfg)
        ckpt = read_state(Path(tmp) / "smoke" / "softmax" / "checkpoints" / "last")
    out = Path(__file__).with_name("smoke_softmax_loss.json")
    out.write_text(
        json.dumps(
            {
                "preset": "smoke",
                "arm": "softmax",
                "torch": torch.__version__,
                "loss": ckpt["history"]["loss"],
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
