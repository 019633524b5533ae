"""Regenerate the golden loss curves of one gated sigmoid cell of the KV-eviction study (tiny
preset, cell sig-g-rope, 30 steps, CPU):

    python tests/golden/make_golden_kv.py              # the preset's recipe
    python tests/golden/make_golden_kv.py --literal    # the paper's literal form (LITERAL below)

The literal curve was recorded before the recipe existed (the lab's schedule then); a test keeps
it reproducible with the four keys below. Then check them as tests/golden/README.md says
(pytest tests/test_golden.py)."""

import json
import sys
import tempfile
from pathlib import Path

import torch

from stabilitylab.config import parse
from stabilitylab.train import run
from stabilitylab.train.checkpoint import read_state

STEPS = 30
CELL = "sig-g-rope"
LITERAL = [
    "--train.budget_norm=mean", "--train.budget_ramp=0", "--train.lr_decay=none",
    "--train.gate_weight_decay=True",
]  # fmt: skip
FILES = {False: "kv_tiny_sig_g_rope_loss.json", True: "kv_tiny_sig_g_rope_literal_loss.json"}

if __name__ == "__main__":
    literal = "--literal" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--preset", "tiny", "--cells", CELL, f"--out_dir={tmp}", "--report=False"]
        cfg = parse([*argv, f"--train.steps={STEPS}", *(LITERAL if literal else [])])
        run(cfg)
        ckpt = read_state(Path(tmp) / "kv_tiny" / CELL / "checkpoints" / "last")
    out = Path(__file__).with_name(FILES[literal])
    record = {"preset": "tiny", "cell": CELL, "torch": torch.__version__}
    if literal:
        record["overrides"] = LITERAL
    out.write_text(json.dumps({**record, "loss": ckpt["history"]["loss"]}, indent=1))
    print(f"wrote {out}")
