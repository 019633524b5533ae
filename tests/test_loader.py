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


def _padding(item) -> int:
    return sum(b.tokens_BT.numel() for b in item.micro) - sum(item.lengths)


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_step_holds_the_same_samples_by_length(cells, source, cfg, world):
    """train.group_by_length: the rank's share of the step, longest first, micro_batch at a time;
    every row is the sample it is in the ungrouped step, and the step's counts are unchanged."""
    for rank in range(world):
        kw = dict(global_batch=16, micro_batch=4, rank=rank, world=world)
        plain = StepBatches(cells, **kw)[2]
        grouped = StepBatches(cells, **kw, group_by_length=True)[2]
        assert len(grouped.micro) == len(plain.micro)
        assert all(b.tokens_BT.shape[0] == 4 for b in grouped.micro)
        assert sorted(i for b in grouped.micro for i in b.indices) == sorted(
            i for b in plain.micro for i in b.indices
        )
        assert torch.equal(grouped.counts_2, plain.counts_2)
        assert grouped.first_index == plain.first_index
        lengths = [int(n) for b in grouped.micro for n in b.lengths_B]
        assert lengths == sorted(lengths, reverse=True) and lengths == grouped.lengths
        assert _padding(grouped) <= _padding(plain)
        for b in grouped.micro:
            for row, index in enumerate(b.indices):
                one = cells([index])
                n = int(one.lengths_B[0])
                assert int(b.lengths_B[row]) == n
                assert torch.equal(b.tokens_BT[row, :n], one.tokens_BT[0])
                assert torch.equal(b.labels_BT[row, :n], one.labels_BT[0])
                assert (b.tokens_BT[row, n:] == 0).all() and (b.labels_BT[row, n:] == -100).all()
            assert b.n_masked == int((b.labels_BT != -100).sum())


def test_grouping_changes_nothing_at_micro_batch_one(cells):
    kw = dict(global_batch=8, micro_batch=1, rank=0, world=1)
    plain, grouped = StepBatches(cells, **kw)[1], StepBatches(cells, **kw, group_by_length=True)[1]
    assert all(same(a, b) for a, b in zip(plain.micro, grouped.micro, strict=True))


def test_the_loader_takes_group_by_length_from_the_config(source):
    cfg = C.parse(
        [
            "--preset",
            "smoke",
            "--train.global_batch=8",
            "--train.micro_batch=4",
            "--train.group_by_length=True",
        ]
    )
    item = next(
        iter(
            step_loader(
                masked_cells(source, cfg),
                cfg,
                rank=0,
                world=1,
                start=0,
                num_workers=0,
                pin_memory=False,
            )
        )
    )
    lengths = [int(n) for b in item.micro for n in b.lengths_B]
    assert lengths == sorted(lengths, reverse=True)


def test_group_by_length_must_be_a_bool():
    with pytest.raises(C.ConfigError, match="train.group_by_length"):
        C.TrainConfig(group_by_length="yes")


def test_stack_batches_pads_to_the_longest_row(cells):
    from stabilitylab.data.batch import stack_batches

    short, long_ = sorted((cells([i]) for i in range(6)), key=lambda b: int(b.lengths_B[0]))[::5]
    both = stack_batches([short, long_])
    assert both.tokens_BT.shape == (2, long_.tokens_BT.shape[1])
    assert both.indices == short.indices + long_.indices
    assert both.n_masked == short.n_masked + long_.n_masked
    n = short.tokens_BT.shape[1]
    assert torch.equal(both.tokens_BT[0, :n], short.tokens_BT[0])
    assert (both.tokens_BT[0, n:] == 0).all() and (both.labels_BT[0, n:] == -100).all()
    with pytest.raises(ValueError, match="at least one batch"):
        stack_batches([])


@pytest.mark.parametrize("group", [False, True])
def test_pad_to_multiple_rounds_each_micro_batch_and_changes_no_row(source, group):
    """data.pad_to_multiple: every micro-batch's length a multiple of it, every row the sample of
    the unrounded batch followed by masked padding (PAD tokens, ignored labels)."""
    args = ["--preset", "smoke", "--train.global_batch=8", "--train.micro_batch=2"]
    args += [f"--train.group_by_length={group}"]
    plain_cfg = C.parse(args)
    padded_cfg = C.parse(args + ["--data.pad_to_multiple=32"])
    kw = dict(global_batch=8, micro_batch=2, rank=0, world=1, group_by_length=group)
    plain = StepBatches(masked_cells(source, plain_cfg), **kw)[1]
    padded = StepBatches(masked_cells(source, padded_cfg), **kw)[1]
    assert any(b.tokens_BT.shape[1] % 32 for b in plain.micro)  # the knob has work to do
    for a, b in zip(plain.micro, padded.micro, strict=True):
        T_a, T_b = a.tokens_BT.shape[1], b.tokens_BT.shape[1]
        assert T_b % 32 == 0 and T_a <= T_b < T_a + 32
        assert a.indices == b.indices and torch.equal(a.lengths_B, b.lengths_B)
        assert torch.equal(b.tokens_BT[:, :T_a], a.tokens_BT)
        assert torch.equal(b.labels_BT[:, :T_a], a.labels_BT)
        assert (b.tokens_BT[:, T_a:] == 0).all() and (b.labels_BT[:, T_a:] == -100).all()
        assert b.n_masked == a.n_masked
    assert torch.equal(padded.counts_2, plain.counts_2)


@pytest.mark.parametrize(
    "args, match",
    [
        (["--data.pad_to_multiple=0"], "positive divisor of data.context_len=128"),
        (["--data.pad_to_multiple=48"], "positive divisor of data.context_len=128, got 48"),
    ],
)
def test_pad_to_multiple_must_divide_the_context(args, match):
    with pytest.raises(C.ConfigError, match=match):
        C.parse(["--preset", "smoke", *args])


def test_pad_to_multiple_is_refused_on_text_windows():
    with pytest.raises(C.ConfigError, match="data.pad_to_multiple.*cell batches only"):
        C.DataConfig(source="text", context_len=128, pad_to_multiple=64)
