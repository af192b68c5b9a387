"""`prepare(loader)`: the user's DataLoader rebuilt to shard over ranks and feed the device."""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from phalanx.data.sampler import BatchShardSampler, ShardedSampler
from phalanx.runtime.collectives import move_to_device
from phalanx.runtime.context import DistContext

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

    Each new pass advances the sampler's epoch, so shuffling differs per epoch without the
    user calling `set_epoch`. `len()` is the number of batches on this rank, equal on all ranks.
    """

    def __init__(self, loader: DataLoader, ctx: DistContext, *, seed: int = 0,
                 device_placement: bool = True, batch_info: BatchInfo | None = None):
        self.original = loader
        self.ctx = ctx
        self.device_placement = device_placement
        self.batch_info = batch_info if batch_info is not None else BatchInfo()
        self.epoch = 0  # the epoch the next pass will use
        self.seed = seed
        # Rebuilt even in a world of one: the sample order is then the same global order that N
        # ranks share out, so results do not depend on the world size.
        self.loader = _shard(loader, ctx, seed)

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
        return len(self.loader)

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
            self.batch_info.size, self.batch_info.num_real = size, real
            yield move_to_device(batch, self.ctx.device) if self.device_placement else batch
        self.batch_info.size = self.batch_info.num_real = None


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
        warnings.warn(
            "phalanx: an IterableDataset cannot be split by index; every rank iterates it whole. "
            "Shard it inside the dataset by rank, or use a map-style Dataset.",
            stacklevel=3,
        )
        return loader
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
