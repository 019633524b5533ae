"""Regenerate the golden loss curve of one gated sigmoid cell of the KV-eviction study (tiny
preset, cell sig-g-rope, 30 steps, CPU): python tests/golden/make_golden_kv.py

Then check it as tests/golden/README.md says (pytest tests/test_golden.py)."""

import json
import tempfile
from pathlib import Path

import torch

from stabilitylab.config import parse
from stabilitylab.train import run
from stabilitylab.train.checkpoint import read_state

STEPS = 30
CELL = "sig-g-rope"

if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse(
            [
                "--preset",
                "tiny",
                "--cells",
                CELL,
                f"--out_dir={tmp}",
                "--report=False",
                f"--train.steps={STEPS}",
            ]
        )
        run(cfg)
        ckpt = read_state(Path(tmp) / "kv_tiny" / CELL / "checkpoints" / "last")
    out = Path(__file__).with_name("kv_tiny_sig_g_rope_loss.json")
    out.write_text(
        json.dumps(
            {
                "preset": "tiny",
                "cell": CELL,
                "torch": torch.__version__,
                "loss": ckpt["history"]["loss"],
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
