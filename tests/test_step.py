"""The optimizer step: it never reads a device value; its one read returns every number."""

import math

import pytest
import torch

from stabilitylab import config as C
from stabilitylab.data import build_source
from stabilitylab.data.loader import masked_cells, step_loader
from stabilitylab.telemetry import StepTelemetry, global_grad_norm
from stabilitylab.train import build
from stabilitylab.train.step import read_numbers, train_step

HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


@pytest.fixture
def trainee_and_batch():
    from accelerate import Accelerator

    cfg = C.parse(
        [
            "--preset",
            "smoke",
            "--train.global_batch=4",
            "--train.micro_batch=2",
            "--data.context_len=32",
            "--data.min_genes=8",
            "--telemetry.layer_every=1",
            "--telemetry.logit_every=1",
            "--train.clip_grad=0.5",
        ]
    )
    model = build.build_model(cfg, "sigmoid-reference", 512 + C.N_SPECIAL_TOKENS)
    accelerator = Accelerator(cpu=True)
    t = build.prepare(cfg, accelerator, model, accum=2)
    tel = StepTelemetry(cfg, t.raw, world=1, cuda=False)
    source = masked_cells(build_source(cfg.data, cfg.train.seed), cfg)
    data = next(
        iter(step_loader(source, cfg, rank=0, world=1, start=0, num_workers=0, pin_memory=False))
    )
    return cfg, t, tel, data


def test_the_step_reads_nothing_from_the_device(trainee_and_batch, monkeypatch):
    cfg, t, tel, data = trainee_and_batch

    def refuse(*_a, **_k):
        raise AssertionError("host read inside the step")

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, refuse)
        out = train_step(t, data, 1e-3, cfg.train.clip_grad, tel)
    numbers = read_numbers(out)
    assert math.isfinite(numbers.loss) and numbers.grad_norm > 0
    assert numbers.n_tokens == sum(data.lengths)
    assert len(numbers.layer_stats_3L) == 3 and len(numbers.layer_stats_3L[0]) == 2
    assert len(numbers.max_LH) == 2 and len(numbers.max_LH[0]) == 4
    assert all(r > 0 for r in numbers.layer_stats_3L[2]), "every layer was updated"


def test_global_grad_norm_is_the_norm_of_all_gradients():
    a, b, c = (torch.zeros(3, requires_grad=True) for _ in range(3))
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 12.0])
    assert global_grad_norm([a, b, c]).item() == pytest.approx(13.0)
    assert global_grad_norm([c]).item() == 0.0
