import json
import subprocess
import sys
from pathlib import Path

import pytest

from stabilitylab import config as C

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(C.PRESETS))
def test_presets_build_and_round_trip(name):
    cfg = C.PRESETS[name]()
    assert cfg.preset == name
    again = C.from_dict(json.loads(C.dumps(cfg)))
    assert again == cfg


def test_stress_8k_matches_the_paper():
    c = C.stress_8k()
    m, t, d = c.model, c.train, c.data
    assert (m.n_layers, m.d_model, m.n_heads, m.head_dim, m.d_ff) == (12, 768, 12, 64, 3072)
    assert (m.dropout, m.ln_eps, m.init_std) == (0.02, 1e-5, 0.02)
    assert (t.lr, t.weight_decay, t.beta1, t.beta2, t.eps) == (1e-4, 0.1, 0.9, 0.999, 1e-8)
    assert (t.warmup_steps, t.steps, t.global_batch, t.seed) == (10_000, 80_000, 256, 42)
    assert t.clip_grad is None and d.context_len == 8192 and d.mask_prob == 0.15
    assert m.sigmoid_bias is None and not m.qk_layernorm


def test_diverge_fast_is_the_measured_hunt_setting():
    """The preset must resolve to exactly the overrides the GPU hunt ran (docs/RESULTS.md, 3),
    with the eager softmax of the repeat study (SDPA's backward is not reproducible run to run)."""
    hunt = C.parse(
        ["--preset", "proxy", "--sigmoid_backend=sigmoid-reference", "--train.weight_decay=0.0",
         "--softmax_backend=softmax-reference",
         "--model.n_layers=8", "--model.d_model=512", "--model.n_heads=8", "--model.d_ff=2048",
         "--train.lr=0.1", "--train.seed=1"]
    )  # fmt: skip
    preset = C.parse(["--preset", "diverge_fast"])
    strip = lambda c: {k: v for k, v in C.to_dict(c).items() if k not in ("preset", "name")}
    assert strip(preset) == strip(hunt)


def test_overrides_are_typed():
    cfg = C.parse(
        [
            "--preset",
            "smoke",
            "--train.lr=3e-3",
            "--model.qk-layernorm",
            "True",
            "--model.sigmoid-bias",
            "-2.5",
            "--arm",
            "softmax",
        ]
    )
    assert cfg.train.lr == 3e-3 and isinstance(cfg.train.lr, float)
    assert cfg.model.qk_layernorm is True and cfg.model.sigmoid_bias == -2.5
    assert cfg.arms() == ["softmax"]
    assert C.parse(["--preset", "smoke"]).model.sigmoid_bias is None


@pytest.mark.parametrize(
    "args, key",
    [
        (["--train.lrr=3"], "train.lrr"),
        (["--train.lr=abc"], "train.lr"),
        (["--train.lr=-1"], "train.lr"),
        (["--model.n-heads=5"], "n_heads"),
        (["--data.mask-prob=1.5"], "data.mask_prob"),
        (["--arm", "relu"], "arm"),
    ],
)
def test_bad_overrides_fail_naming_the_key(args, key):
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from stabilitylab.config import parse; parse(sys.argv[1:])",
            "--preset",
            "smoke",
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode != 0
    err = proc.stderr.replace("-", "_")
    assert key.replace("-", "_") in err, proc.stderr


def test_unknown_preset_is_named():
    with pytest.raises(C.ConfigError, match="bogus"):
        C.parse(["--preset", "bogus"])


def test_stress_script_refuses_without_cuda_and_names_cpu_preset():
    import torch

    if torch.cuda.is_available():
        pytest.skip("machine has CUDA")
    proc = subprocess.run(
        [sys.executable, "experiments/stress_8k.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--preset smoke" in proc.stderr and "CUDA" in proc.stderr
