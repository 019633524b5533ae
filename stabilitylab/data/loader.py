"""One optimizer step's micro-batches per item, built by a torch DataLoader.

    make_micro = masked_cells(source, cfg)      # or a next-token batch function over text
    loader = step_loader(make_micro, cfg, rank=r, world=w, start=s, num_workers=2, pin_memory=True)
    for data in loader:            # data.step = s, s + 1, ... cfg.train.steps - 1
        ...

``make_micro(indices)`` builds one micro-batch (a :class:`~stabilitylab.data.batch.Batch`) from
global sample indices: masked cells (:func:`masked_cells`) or next-token text windows
(``stabilitylab.train.task``). Item ``step`` of :class:`StepBatches` is this rank's share of the
global batch of that step: ``accum`` micro-batches of ``micro_batch`` samples each, micro-batch
``i`` holding the global samples ``step * global_batch + rank * per_rank + i * micro_batch +
[0, micro_batch)`` with ``per_rank = global_batch / world``. With ``group_by_length`` the rank's
share of the step is instead ordered by length (longest first, ties by index) before it is cut
into micro-batches, so that a micro-batch holds sequences of like length and little padding: the
step's sequences, and so its summed loss and gradient, are the same; only the rounding and the
dropout draws move (``train.group_by_length``). So the data order depends on the seed
and the global batch only, never on the process count or the number of loader workers (a sample
depends on (seed, index) alone: each cell's masking draws from its own generator, see
:mod:`stabilitylab.data.batch`; text windows, :mod:`stabilitylab.data.text.windows`).

The loader never touches the global torch RNG (it gets its own generator), so dropout draws in
the training step are the same with or without the loader, and after a resume.
"""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from stabilitylab.config import Config
from stabilitylab.data.batch import Batch, make_batch, stack_batches
from stabilitylab.data.source import CellSource

MicroBatchFn = Callable[[Sequence[int]], Batch]
"""Global sample indices -> one micro-batch (CPU tensors); depends on the indices alone."""


def masked_cells(source: CellSource, cfg: Config) -> MicroBatchFn:
    """The stress study's micro-batches: cells of ``source``, masked (``make_batch``)."""
    return functools.partial(
        make_batch,
        source,
        context_len=cfg.data.context_len,
        mask_prob=cfg.data.mask_prob,
        seed=cfg.train.seed,
        pad_to_multiple=cfg.data.pad_to_multiple,
    )


@dataclass
class StepBatch:
    """This rank's micro-batches of one optimizer step and the counts its loss needs."""

    step: int
    micro: list[Batch]
    counts_2: torch.Tensor
    """float32 ``[predicted tokens, valid tokens]`` of this rank's micro-batches (masked cells;
    next-token targets)."""
    lengths: list[int]
    """Valid tokens of every sequence, host integers (the FLOP count reads them, no sync)."""
    first_index: int
    """Global sample index of this rank's first sample of the step."""

    def pin_memory(self) -> StepBatch:
        """Page-locked copies, so that ``to(device, non_blocking=True)`` is truly asynchronous
        (the DataLoader's pin-memory thread calls this)."""
        return StepBatch(
            self.step,
            [
                Batch(
                    tokens_BT=b.tokens_BT.pin_memory(),
                    labels_BT=b.labels_BT.pin_memory(),
                    lengths_B=b.lengths_B.pin_memory(),
                    indices=b.indices,
                    n_masked=b.n_masked,
                )
                for b in self.micro
            ],
            self.counts_2.pin_memory(),
            self.lengths,
            self.first_index,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StepBatch:
        return StepBatch(
            self.step,
            [b.to(device, non_blocking=non_blocking) for b in self.micro],
            self.counts_2.to(device, non_blocking=non_blocking),
            self.lengths,
            self.first_index,
        )


class StepBatches(Dataset):
    """Map-style dataset over optimizer steps: item ``step`` is a :class:`StepBatch`."""

    def __init__(
        self,
        make_micro: MicroBatchFn,
        *,
        global_batch: int,
        micro_batch: int,
        rank: int,
        world: int,
        group_by_length: bool = False,
    ):
        if global_batch % (micro_batch * world):
            raise ValueError(
                f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch} "
                f"x processes={world}"
            )
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        self.make_micro = make_micro
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rank, self.per_rank = rank, global_batch // world
        self.accum = self.per_rank // micro_batch
        self.group_by_length = group_by_length

    def first_index(self, step: int) -> int:
        return step * self.global_batch + self.rank * self.per_rank

    def __getitem__(self, step: int) -> StepBatch:
        base = self.first_index(step)
        if self.group_by_length and self.micro_batch > 1:
            micro = self._grouped(base)
        else:
            micro = [
                self.make_micro(
                    range(base + i * self.micro_batch, base + (i + 1) * self.micro_batch)
                )
                for i in range(self.accum)
            ]
        lengths = [int(n) for b in micro for n in b.lengths_B.tolist()]  # CPU tensors: no sync
        counts_2 = torch.tensor([sum(b.n_masked for b in micro), sum(lengths)], dtype=torch.float32)
        return StepBatch(step, micro, counts_2, lengths, base)

    def _grouped(self, base: int) -> list[Batch]:
        """The rank's samples of the step one by one, longest first, stacked ``micro_batch`` at a
        time (each sample is built alone, so it is the same sample as in any other grouping)."""
        ones = [self.make_micro([base + i]) for i in range(self.per_rank)]
        order = sorted(range(self.per_rank), key=lambda i: (-int(ones[i].lengths_B[0]), i))
        m = self.micro_batch
        return [stack_batches([ones[i] for i in order[j : j + m]]) for j in range(0, len(order), m)]


def _as_is(item: StepBatch) -> StepBatch:
    return item


def _ignore_stop_signals(_worker_id: int) -> None:
    """Workers leave SIGINT / SIGTERM to the training process, which stops at the end of a step
    and shuts them down; Ctrl-C reaches the whole process group and would otherwise kill them
    mid-batch. A worker whose parent dies exits on its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def step_loader(
    make_micro: MicroBatchFn,
    cfg: Config,
    *,
    rank: int,
    world: int,
    start: int,
    num_workers: int,
    pin_memory: bool,
) -> DataLoader:
    """Steps ``start .. cfg.train.steps - 1`` of this rank, ``num_workers`` building ahead."""
    dataset = StepBatches(
        make_micro,
        global_batch=cfg.train.global_batch,
        micro_batch=cfg.train.micro_batch,
        rank=rank,
        world=world,
        group_by_length=cfg.train.group_by_length,
    )
    return DataLoader(
        dataset,
        batch_size=None,  # an item already is one step's batch
        sampler=range(start, cfg.train.steps),
        num_workers=num_workers,
        collate_fn=_as_is,
        pin_memory=pin_memory,
        worker_init_fn=_ignore_stop_signals,
        # Without its own generator the loader draws its base seed from the global RNG when an
        # iterator starts, which would shift every later dropout draw (and differ after a resume).
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )
