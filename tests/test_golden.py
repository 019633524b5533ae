"""The committed golden loss curves (tests/golden/) checked against what any correct model gives,
independently of the code that made them: test_train and test_kv_study only pin drift (a fresh
run reproduces the file), which a curve made by broken code would pass as well.

At init every logit is ``z_v = h . w_v`` with ``h`` the final LayerNorm's output (unit variance
per coordinate) and ``w_v ~ N(0, s^2)``, ``s = init_std * init_scale``: Gaussian logits of
variance ``sigma^2 = d_model * s^2`` (0.0256 in both presets), whose log-sum-exp over V tokens is
``ln V + sigma^2 / 2`` in expectation while the label's logit averages 0. So the first loss is
``ln V`` (+ the budget term ``lambda(step 0) * sigmoid(gate_bias_init)`` of a gated cell, whose
gates all read sigmoid(b) at init, normalised as train.budget_norm says; 0 under a lambda ramp) plus at most ``sigma^2 / 2`` = 0.013, give or take the first
batch's sampling noise: per-token CE varies by ~sigma = 0.16 over its ~300 (smoke) or 512 (tiny)
labelled tokens, 0.007-0.009 nats, 0.03 at over 3 of those. A golden curve made with a loss
summed instead of averaged, another vocabulary size (2x: 0.69 nats) or weights initialised 3x
too wide (smoke: 0.093 above ln V, measured) fails here; the tolerance is too wide to see the
tiny cell's budget term (0.03) go missing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from stabilitylab.config import Config
from stabilitylab.model import vocab_size_for
from stabilitylab.presets import KV_PRESETS, PRESETS
from stabilitylab.train.build import budget_lambda_at
from stabilitylab.train.task import text_task

GOLDEN = Path(__file__).resolve().parent / "golden"
NOISE = 0.03  # nats: > 3x the first batch's sampling noise (module docstring)


def _smoke() -> tuple[Config, int]:
    cfg = PRESETS["smoke"]()
    return cfg, vocab_size_for(cfg.data.n_genes)


def _kv_tiny(literal: bool = False) -> tuple[Config, int]:
    cfg = KV_PRESETS["tiny"]()
    if literal:  # the paper's literal budget and schedule (tests/golden/make_golden_kv.py)
        t = cfg.train
        t.budget_norm, t.budget_ramp, t.lr_decay, t.gate_weight_decay = "mean", 0.0, "none", True
    return cfg.arm_config("sig-g-rope"), text_task(cfg).vocab_size


CURVES = {
    "smoke_softmax_loss.json": _smoke,
    "kv_tiny_sig_g_rope_loss.json": _kv_tiny,
    "kv_tiny_sig_g_rope_literal_loss.json": lambda: _kv_tiny(literal=True),
}


def expected_first_loss(cfg: Config, vocab: int) -> tuple[float, float]:
    """``(ln V + the budget term at init, sigma^2 / 2)`` of the module docstring."""
    m = cfg.model
    budget = 0.0
    if m.gates:  # every gate reads sigmoid(b) at init: the term is lambda(0) * that, normalised
        t, n_gates = cfg.train, m.n_layers - 1
        scale = n_gates / (t.budget_ref_layers - 1) if t.budget_norm == "per_gate" else 1.0
        budget = budget_lambda_at(cfg, 0) * scale / (1 + math.exp(-m.gate_bias_init))
    return math.log(vocab) + budget, m.d_model * (m.init_std * m.init_scale) ** 2 / 2


def test_every_golden_file_is_checked():
    assert {p.name for p in GOLDEN.glob("*.json")} == set(CURVES)


@pytest.mark.parametrize("name", sorted(CURVES))
def test_a_golden_curve_starts_at_ln_vocab_and_learns(name):
    golden = json.loads((GOLDEN / name).read_text())
    cfg, vocab = CURVES[name]()
    assert golden["preset"] == cfg.preset
    base, spread = expected_first_loss(cfg, vocab)
    first = golden["loss"][0]
    assert base - NOISE <= first <= base + spread + NOISE, (first, base, spread, vocab)
    # 30 steps of a working optimizer: the last five below the first five by more than noise.
    loss = golden["loss"]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 5 * NOISE, loss
