"""`prepare(loader)`: the user's DataLoader rebuilt to shard over ranks and feed the device."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from phalanx.data.equalize import agree_num_batches, agree_step, gather_ints, lend_batch
from phalanx.data.iterable import ShardedIterable
from phalanx.data.sampler import BatchShardSampler, ShardedSampler
from phalanx.runtime.collectives import move_to_device
from phalanx.runtime.context import DistContext
from phalanx.runtime.progress import Progress

# DataLoader arguments carried over verbatim when the loader is rebuilt around a new sampler.
_CARRIED = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
            "multiprocessing_context", "persistent_workers", "pin_memory_device", "in_order")


@dataclass
class BatchInfo:
    """What the loader knows of the batch it yielded last; read by gather_for_metrics."""

    size: int | None = None  # samples in the batch on this rank
    num_real: int | None = None  # of those, how many are not padding repeats


class PreparedLoader:
    """Iterates a rank's shard of the user's DataLoader, with batches moved to the device.

    Every rank yields the same number of batches per pass, whatever the dataset size, batch size
    or drop_last, so no rank ever waits in a collective that a peer will not reach:
    - a map-style dataset sharded by phalanx is equal by construction (DistributedSampler-style
      padding, or dropping with drop_last);
    - pre-sharded data (`shard=False`) or per-rank datasets of different lengths: the ranks agree
      on a batch count at the start of each pass; short ranks repeat batches (marked as padding,
      so gather_for_metrics skips them) or, with drop_last, long ranks stop early;
    - an IterableDataset (length unknown): the ranks agree at every step whether anyone still has
      data, padding or stopping the same way.

    Each new pass advances the sampler's epoch, so shuffling differs per epoch without the
    user calling `set_epoch`. `len()` is the number of batches on this rank, equal on all ranks.
    """

    def __init__(self, loader: DataLoader, ctx: DistContext, *, seed: int = 0,
                 device_placement: bool = True, batch_info: BatchInfo | None = None,
                 shard: bool = True, progress: Progress | None = None):
        self.original = loader
        self.ctx = ctx
        self.device_placement = device_placement
        self.batch_info = batch_info if batch_info is not None else BatchInfo()
        self.progress = progress
        self.epoch = 0  # the epoch the next pass will use
        self.seed = seed
        # Rebuilt even in a world of one: the sample order is then the same global order that N
        # ranks share out, so results do not depend on the world size.
        self.loader = _shard(loader, ctx, seed) if shard else loader
        self.drop = _drops_last(self.loader)
        self.mode = _equalising_mode(self.loader, ctx, shard)
        self._num_batches = agree_num_batches(len(self.loader), self.drop) if self.mode == "count" else None

    @property
    def sampler(self):
        return self.loader.sampler

    @property
    def batch_sampler(self):
        return self.loader.batch_sampler

    @property
    def dataset(self):
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def __len__(self) -> int:
        if self.mode == "count":
            return self._num_batches  # type: ignore[return-value]
        return len(self.loader)  # an IterableDataset without __len__ raises TypeError, as torch's does

    def set_epoch(self, epoch: int) -> None:
        """For scripts that call it themselves (as with DistributedSampler): same effect."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1
        for s in (self.loader.sampler, self.loader.batch_sampler):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        if self.loader is not self.original and self.loader.generator is not None:
            # Our own generator, re-seeded per epoch: a DataLoader without one draws its base seed
            # from the global torch RNG at every iter(), coupling the data to the model's randomness.
            self.loader.generator.manual_seed(self.seed + epoch)
        if self.mode == "fixed":
            batches = self._one_pass()
        elif self.mode == "count":
            self._num_batches = agree_num_batches(len(self.loader), self.drop)
            batches = self._counted(self._num_batches)
        else:
            batches = self._agreed_per_step()
        progress = self.progress
        for batch, real in batches:
            self.batch_info.size, self.batch_info.num_real = _batch_len(batch), real
            if progress is not None:
                progress.next_step()
            yield move_to_device(batch, self.ctx.device) if self.device_placement else batch
            if progress is not None:
                progress.enter("data")
        self.batch_info.size = self.batch_info.num_real = None

    def _one_pass(self) -> Iterator[tuple[Any, int | None]]:
        """One pass over the underlying loader: (batch, how many of its samples are not padding)."""
        real_left = _real_samples(self.loader)
        pad_flags = None
        for index, batch in enumerate(self.loader):
            if pad_flags is None and isinstance(self.loader.batch_sampler, BatchShardSampler):
                pad_flags = self.loader.batch_sampler.padding_flags
            size = _batch_len(batch)
            if pad_flags is not None:
                real = 0 if pad_flags[index] else size
            elif real_left is not None and size is not None:
                real = max(0, min(size, real_left))
                real_left -= size
            else:
                real = size
            yield batch, real

    def _counted(self, target: int) -> Iterator[tuple[Any, int | None]]:
        """Exactly `target` batches: this rank's own, then repeats of them marked as padding."""
        count = 0
        for item in self._one_pass():
            if count == target:
                return
            yield item
            count += 1
        while count < target:
            for batch, _ in self._one_pass():
                if count == target:
                    return
                yield batch, 0
                count += 1

    def _agreed_per_step(self) -> Iterator[tuple[Any, int | None]]:
        """Length unknown: before each step, all ranks agree whether to go on (and who pads)."""
        it = self._one_pass()
        last = None
        while True:
            item = next(it, None)
            decision = agree_step(item is not None, last is not None, self.drop)
            if not decision.proceed:
                return
            if decision.donor is not None:  # some rank has nothing to repeat yet: borrow a batch
                lent = lend_batch(item[0] if item is not None else None, decision.donor)
                if last is None and item is None:
                    last = (lent, 0)
            if item is None:
                yield last[0], 0  # type: ignore[index]
            else:
                last = item
                yield item


def _real_samples(loader: DataLoader) -> int | None:
    sampler = loader.sampler
    if isinstance(sampler, ShardedSampler):
        return sampler.num_real_samples
    return None


def _batch_len(batch: Any) -> int | None:
    """Length along dim 0 of the first tensor found in the batch."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    if not isinstance(batch, (dict, list, tuple)) and hasattr(batch, "keys"):  # BatchEncoding
        values = [batch[k] for k in batch.keys()]
    for v in values:
        n = _batch_len(v)
        if n is not None:
            return n
    return None


def _shard(loader: DataLoader, ctx: DistContext, seed: int) -> DataLoader:
    """Rebuild `loader` so this rank sees its shard; keep every other setting."""
    kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
    else:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        # Workers of an unwrapped IterableDataset each replay the whole stream: shard per worker
        # too, even in a world of one.
        return DataLoader(ShardedIterable(dataset, ctx.rank, ctx.world_size), batch_size=loader.batch_size,
                          drop_last=loader.drop_last, **kwargs)
    generator = torch.Generator()
    generator.manual_seed(seed)
    sampler = loader.sampler
    if loader.batch_size is not None and isinstance(sampler, (RandomSampler, SequentialSampler)) \
            and type(loader.batch_sampler) is BatchSampler:
        sharded = ShardedSampler(
            dataset, num_replicas=ctx.world_size, rank=ctx.rank,
            shuffle=isinstance(sampler, RandomSampler), seed=seed, drop_last=loader.drop_last,
        )
        return DataLoader(dataset, batch_size=loader.batch_size, sampler=sharded,
                          drop_last=loader.drop_last, generator=generator, **kwargs)
    # A custom sampler or batch sampler: deal its whole batches to ranks.
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the sampler yields single samples
        raise ValueError(
            "phalanx cannot shard a DataLoader built with batch_size=None. "
            "Give it a batch_size (or a batch_sampler) so batches can be dealt to ranks."
        )
    drop_last = bool(getattr(batch_sampler, "drop_last", False))
    shard = BatchShardSampler(batch_sampler, ctx.world_size, ctx.rank, drop_last=drop_last)
    return DataLoader(dataset, batch_sampler=shard, generator=generator, **kwargs)


def _drops_last(loader: DataLoader) -> bool:
    """Whether the user chose to drop rather than pad (DataLoader or batch sampler drop_last)."""
    if loader.batch_sampler is not None and hasattr(loader.batch_sampler, "drop_last"):
        return bool(loader.batch_sampler.drop_last)
    return bool(loader.drop_last)


def _equalising_mode(loader: DataLoader, ctx: DistContext, shard: bool) -> str:
    """How equal step counts are ensured: 'fixed' (by construction), 'count' (per pass), 'step'."""
    if not ctx.is_distributed:
        return "fixed"
    if isinstance(loader.dataset, IterableDataset):
        return "step"
    try:
        len(loader)
    except TypeError:  # a custom sampler without __len__
        return "step"
    if not shard:
        return "count"
    try:
        length = len(loader.dataset)  # type: ignore[arg-type]
    except TypeError:
        return "count"
    lengths = gather_ints(length)
    if len(set(lengths)) > 1:
        warnings.warn(
            f"phalanx: the dataset passed to prepare() has a different length on each rank "
            f"(by rank: {lengths}): it looks already split per rank, and sharding it again drops "
            f"data (each rank keeps only 1/{ctx.world_size} of its own part). HINT: pass "
            "prepare(loader, shard=False) to use each rank's data as is; step counts are equalised "
            "either way.",
            stacklevel=4,
        )
        return "count"
    return "fixed"
