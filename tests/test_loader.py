"""Batches from the DataLoader: the same cells in the same order as the index formula, whatever
the workers, and the global RNG left alone."""

import pytest
import torch

from stabilitylab import config as C
from stabilitylab.data import build_source, make_batch
from stabilitylab.data.loader import StepBatches, masked_cells, step_loader


@pytest.fixture(scope="module")
def cfg():
    return C.parse(["--preset", "smoke", "--train.global_batch=8", "--train.micro_batch=2"])


@pytest.fixture(scope="module")
def source(cfg):
    return build_source(cfg.data, cfg.train.seed)


@pytest.fixture(scope="module")
def cells(source, cfg):
    return masked_cells(source, cfg)


def expected(source, cfg, step, rank, world):
    """The trainer's data order: sample ``step * global_batch + rank * per_rank + j``."""
    per_rank = cfg.train.global_batch // world
    base = step * cfg.train.global_batch + rank * per_rank
    mb = cfg.train.micro_batch
    return [
        make_batch(
            source,
            range(base + i * mb, base + (i + 1) * mb),
            context_len=cfg.data.context_len,
            mask_prob=cfg.data.mask_prob,
            seed=cfg.train.seed,
        )
        for i in range(per_rank // mb)
    ]


def same(a, b) -> bool:
    return (
        a.indices == b.indices
        and torch.equal(a.tokens_BT, b.tokens_BT)
        and torch.equal(a.labels_BT, b.labels_BT)
        and torch.equal(a.lengths_B, b.lengths_B)
    )


@pytest.mark.parametrize("world", [1, 2])
def test_each_rank_gets_its_share_of_each_step(cfg, source, cells, world):
    for rank in range(world):
        loader = step_loader(
            cells, cfg, rank=rank, world=world, start=3, num_workers=0, pin_memory=False
        )
        items = [item for _, item in zip(range(2), loader, strict=False)]
        for step, item in zip((3, 4), items, strict=True):
            want = expected(source, cfg, step, rank, world)
            assert item.step == step and len(item.micro) == len(want) == 4 // world
            assert all(same(a, b) for a, b in zip(item.micro, want, strict=True))
            assert item.first_index == want[0].indices[0]
            assert item.lengths == [int(n) for b in want for n in b.lengths_B]
            assert item.counts_2.tolist() == [sum(b.n_masked for b in want), sum(item.lengths)]


def test_workers_change_nothing_and_the_global_rng_is_untouched(cfg, cells):
    rng_before = torch.get_rng_state()
    short = C.parse(
        ["--preset", "smoke", "--train.global_batch=8", "--train.micro_batch=2", "--train.steps=5"]
    )
    a = list(step_loader(cells, short, rank=0, world=1, start=1, num_workers=0, pin_memory=False))
    b = list(step_loader(cells, short, rank=0, world=1, start=1, num_workers=2, pin_memory=False))
    assert [x.step for x in a] == [x.step for x in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert all(same(p, q) for p, q in zip(x.micro, y.micro, strict=True))
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_a_global_batch_the_processes_cannot_share_is_refused(cells):
    with pytest.raises(ValueError, match="global_batch=8 is not a multiple of micro_batch=3"):
        StepBatches(cells, global_batch=8, micro_batch=3, rank=0, world=1)
