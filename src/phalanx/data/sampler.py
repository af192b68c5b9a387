"""Samplers that split a dataset over ranks and know which of their samples are padding."""

from __future__ import annotations

import math
from typing import Iterator, Sequence

from torch.utils.data import BatchSampler, Sampler
from torch.utils.data.distributed import DistributedSampler

from phalanx.data.sample_seeds import tag
from phalanx.data.user_sampler import EpochDraw


class ShardedSampler(DistributedSampler):
    """torch's DistributedSampler (same order, same padding), plus the count of real samples.

    Without drop_last, DistributedSampler repeats the first indices so every rank gets
    `num_samples`; `num_real_samples` says how many of this rank's samples are not repeats,
    which is what lets gather_for_metrics count each item exactly once. With `tag_epoch`, indices
    are yielded as SampleKeys that carry the epoch (for per-sample seeds in workers).
    """

    def __init__(self, *args, tag_epoch: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag_epoch = tag_epoch

    def __iter__(self) -> Iterator[int]:
        indices = super().__iter__()
        return iter(tag(indices, self.epoch)) if self.tag_epoch else indices

    @property
    def num_real_samples(self) -> int:
        if self.drop_last:
            return self.num_samples
        dataset_len = len(self.dataset)  # type: ignore[arg-type]
        return len(range(self.rank, min(dataset_len, self.total_size), self.num_replicas))


class BatchShardSampler(Sampler[list[int]]):
    """Deal whole batches of any batch sampler to ranks round-robin: batch i goes to rank i % world.

    Used for custom batch samplers, whose batches the loader cannot rebuild index-wise. Each epoch's
    batches are drawn the same on every rank and reproduced on resume (user_sampler.EpochDraw: a
    generator of the sampler's own must be seeded identically on every rank). Ranks always get
    the same number of batches: short ranks repeat the first batches (marked as padding) unless
    `drop_last`, which drops the incomplete round instead. With `tag_epoch`, indices are yielded
    as SampleKeys that carry the epoch (for per-sample seeds in workers).
    """

    def __init__(
        self,
        batch_sampler: Sampler[list[int]],
        num_replicas: int,
        rank: int,
        drop_last: bool = False,
        tag_epoch: bool = False,
        seed: int = 0,
    ):
        self.batch_sampler = batch_sampler
        self.draw = EpochDraw(batch_sampler, seed)
        self.tag_epoch = tag_epoch
        self.epoch = 0
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.padding_flags: list[bool] = []  # per yielded batch of the current pass

    def __len__(self) -> int:
        total = len(self.batch_sampler)  # type: ignore[arg-type]
        if self.drop_last:
            return total // self.num_replicas
        return math.ceil(total / self.num_replicas)

    @property
    def batch_size(self) -> int | None:
        """Samples in each batch before an epoch's last: torch's BatchSampler's `batch_size` (a subclass
        that keeps its batching too), so a position can count samples and resume on another world size
        with the same global batch; None for a batch sampler whose batches phalanx cannot size."""
        inner = self.batch_sampler
        if isinstance(inner, BatchSampler) and type(inner).__iter__ is BatchSampler.__iter__:
            return int(inner.batch_size)
        return None

    def __iter__(self) -> Iterator[list[int]]:
        batches: Sequence[list[int]] = self.draw(self.epoch)
        per_rank = len(self)
        needed = per_rank * self.num_replicas
        flags = [False] * min(len(batches), needed)
        if needed > len(batches):
            fill = needed - len(batches)
            batches = list(batches) + [batches[i % len(batches)] for i in range(fill)] if batches else []
            flags += [True] * fill
        mine = range(self.rank, needed, self.num_replicas)
        self.padding_flags = [flags[i] for i in mine] if batches else []
        for i in mine:
            if batches:
                yield tag(batches[i], self.epoch) if self.tag_epoch else list(batches[i])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)
        inner = getattr(self.batch_sampler, "sampler", None)
        if hasattr(inner, "set_epoch"):
            inner.set_epoch(epoch)
