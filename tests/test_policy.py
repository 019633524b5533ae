"""The divergence policy on hand-made step numbers: what it records, what it saves, when it stops."""

import math

import pytest

from stabilitylab.config import Config, TelemetryConfig, TrainConfig
from stabilitylab.train.policy import MAX_CONSECUTIVE_NONFINITE, History, Policy

NAN = float("nan")


def make_policy(on_divergence="stop", log_every=1):
    # A real config: the keys the policy reads must exist, and the values be ones it accepts.
    cfg = Config(
        train=TrainConfig(on_divergence=on_divergence),
        telemetry=TelemetryConfig(log_every=log_every),
    )
    hist, saved, said = History(), [], []
    policy = Policy(cfg, hist, lambda *a: saved.append(a), said.append)
    return policy, hist, saved, said


def feed(policy, hist, step, loss, gn, module="blocks.0.attn"):
    hist.append(step, loss, gn, None)
    return policy.after_step(step, loss, gn, locate=lambda: module, batch=[step * 8, 8])


def test_first_nonfinite_step_is_recorded_once_with_a_forensic_checkpoint():
    policy, hist, saved, said = make_policy("continue")
    for step in range(5):
        assert not feed(policy, hist, step, 5.0 - 0.1 * step, 1.0)
    assert not feed(policy, hist, 5, NAN, 1.0)
    assert not feed(policy, hist, 6, NAN, NAN, module="blocks.1.ff")
    assert policy.status == "diverged" and policy.divergence.step == 5
    assert (
        policy.divergence.reason == "non-finite loss"
        and policy.divergence.module == "blocks.0.attn"
    )
    assert len(saved) == 1 and len(said) == 1
    name, ckpt_step, ckpt_hist, extra = saved[0]
    assert name == "forensic_step5" and ckpt_step == 5
    assert ckpt_hist.steps == [0, 1, 2, 3, 4], "the history before the skipped update"
    assert extra == {
        "divergence": {"step": 5, "reason": "non-finite loss", "module": "blocks.0.attn"},
        "batch_indices": [40, 8],
    }
    assert hist.nonfinite_steps == [5, 6]


def test_a_nonfinite_gradient_with_a_finite_forward_blames_the_backward():
    policy, hist, saved, _ = make_policy("stop")
    assert feed(policy, hist, 0, 5.0, math.inf, module=None)
    assert policy.divergence.reason == "non-finite gradient"
    assert policy.divergence.module == "backward"


def test_continue_stops_after_too_many_nonfinite_steps_in_a_row():
    policy, hist, _, _ = make_policy("continue")
    stops = [feed(policy, hist, s, NAN, NAN) for s in range(MAX_CONSECUTIVE_NONFINITE)]
    assert stops == [False] * (MAX_CONSECUTIVE_NONFINITE - 1) + [True]


def test_a_finite_step_resets_the_nonfinite_count():
    policy, hist, _, _ = make_policy("continue")
    for s in range(MAX_CONSECUTIVE_NONFINITE - 1):
        feed(policy, hist, s, NAN, NAN)
    assert not feed(policy, hist, 100, 5.0, 1.0)
    assert not feed(policy, hist, 101, NAN, NAN)


@pytest.mark.parametrize("on_divergence, stops", [("stop", True), ("continue", False)])
def test_the_detector_fires_on_a_grad_explosion_with_the_loss_back_up(on_divergence, stops):
    policy, hist, saved, _ = make_policy(on_divergence)
    for step in range(10):
        assert not feed(policy, hist, step, 6.0 - 0.1 * step, 1.0)
    assert feed(policy, hist, 10, 7.0, 1e4) is stops
    assert policy.divergence.step == 10 and policy.divergence.module is None
    assert policy.divergence.reason.startswith("grad_explosion")
    name, ckpt_step, ckpt_hist, extra = saved[0]
    assert (name, ckpt_step, ckpt_hist.steps[-1]) == ("forensic_step10", 11, 10)
    feed(policy, hist, 11, 8.0, 1e5)
    assert len(saved) == 1, "one divergence, one forensic checkpoint"


def test_the_detector_runs_on_logged_steps_only():
    policy, hist, saved, _ = make_policy("stop", log_every=5)
    for step in range(10):
        feed(policy, hist, step, 6.0 - 0.1 * step, 1.0)
    assert not feed(policy, hist, 11, 7.0, 1e4)
    assert feed(policy, hist, 15, 7.0, 1.0)
    assert policy.divergence.step == 11 and saved[0][0] == "forensic_step15"


def test_history_before_a_step_and_its_plain_dict():
    h = History()
    for s, loss in enumerate([3.0, NAN, 2.0]):
        h.append(s, loss, 1.0, [[0.5, 2.5]] if s == 2 else None)
    h.wall_time_s = 12.0
    early = h.before(2)
    assert early.steps == [0, 1] and early.nonfinite_steps == [1] and early.wall_time_s == 12.0
    assert h.max_logit == 2.5
    assert History(**h.to_dict()).to_dict() == h.to_dict()
