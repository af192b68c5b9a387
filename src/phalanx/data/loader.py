"""`prepare(loader)`: the user's DataLoader rebuilt to shard over ranks and feed the device."""
from __future__ import annotations

import itertools
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
        # Checkpointing: (epoch, batches yielded) of the pass in progress; batches to skip on resume.
        self._position: tuple[int, int] | None = None
        self._resume: tuple[int, int] | None = None

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

    # ---- checkpointing: the data position as a global count, valid on any world size ----------
    def state_dict(self) -> dict[str, Any]:
        """Epoch and how much of it all ranks together consumed (a yielded batch counts as consumed)."""
        if self._position is not None and self._position[1] < len(self.loader):
            epoch, done = self._position
        else:  # between passes, or the last batch was yielded: the next pass starts at its beginning
            epoch, done = self.epoch, 0
        unit, consumed = _global_count(self.loader, self.original, done, self.ctx.world_size)
        return {"epoch": epoch, "unit": unit, "consumed": consumed, "world_size": self.ctx.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at `state`'s position: the next pass starts `epoch` with the very next batch."""
        skip = _batches_to_skip(self.loader, self.original, state, self.ctx.world_size)
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, skip) if skip else None

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1
        skip = self._resume[1] if self._resume is not None and self._resume[0] == epoch else 0
        self._resume = None
        self._position = (epoch, skip)
        for s in (self.loader.sampler, self.loader.batch_sampler):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)
        if self.loader is not self.original and self.loader.generator is not None:
            # Our own generator, re-seeded per epoch: a DataLoader without one draws its base seed
            # from the global torch RNG at every iter(), coupling the data to the model's randomness.
            self.loader.generator.manual_seed(self.seed + epoch)
        real_left = _real_samples(self.loader)
        if real_left is not None and skip:
            real_left -= skip * (self.loader.batch_size or 0)
        pad_flags = None
        source = _skipping(self.loader, skip)
        batches = (enumerate(source, start=skip) if source is not self.loader
                   else itertools.islice(enumerate(source), skip, None))  # can only skip by reading
        for index, batch in batches:
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
            self._position = (epoch, index + 1)
            yield move_to_device(batch, self.ctx.device) if self.device_placement else batch
        self.batch_info.size = self.batch_info.num_real = None


def _global_count(loader: DataLoader, original: DataLoader, done: int, world_size: int) -> tuple[str, int]:
    """`done` batches per rank as a count over all ranks, in the unit the global order is dealt in."""
    if loader is original:  # IterableDataset: not sharded by phalanx, only a per-rank count exists
        return "batches_per_rank", done
    if isinstance(loader.batch_sampler, BatchShardSampler):  # whole batches dealt round-robin
        return "batches", done * world_size
    return "samples", done * int(loader.batch_size) * world_size  # DistributedSampler's global order


def _batches_to_skip(loader: DataLoader, original: DataLoader, state: dict[str, Any], world_size: int) -> int:
    unit, consumed, saved_world = state["unit"], int(state["consumed"]), int(state["world_size"])
    expected_unit, _ = _global_count(loader, original, 0, world_size)
    if unit != expected_unit:
        raise ValueError(f"the checkpoint counts data in {unit}, this loader in {expected_unit}: "
                         "HINT: resume with the same DataLoader setup (sampler, batch_size) as the saved run")
    if unit == "batches_per_rank":
        if saved_world != world_size:
            raise ValueError(f"an IterableDataset position saved on {saved_world} ranks cannot map to "
                             f"{world_size}. HINT: resume on {saved_world} ranks or use a map-style Dataset")
        return consumed
    per_step = world_size * (int(loader.batch_size) if unit == "samples" else 1)
    if consumed % per_step:
        raise ValueError(
            f"the checkpoint's data position ({consumed} {unit} into epoch {state['epoch']}) is not a whole "
            f"number of steps of {per_step} {unit} (world_size={world_size} x this loader's batch). HINT: keep "
            f"the global batch: batch_size = global batch / world_size (it was {saved_world} ranks)")
    return consumed // per_step


def _skipping(loader: DataLoader, skip: int) -> DataLoader:
    """`loader`, or a twin whose batch sampler skips the first `skip` batches without loading them."""
    if not skip or loader.batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        return loader  # the IterableDataset case skips by iterating (islice in __iter__)
    kwargs = {name: getattr(loader, name) for name in _CARRIED if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs["persistent_workers"] = False
    else:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, batch_sampler=_SkipFirst(loader.batch_sampler, skip),
                      generator=loader.generator, **kwargs)


class _SkipFirst:
    """A batch sampler minus its first `skip` batches (indices only: no data is loaded for them)."""

    def __init__(self, batch_sampler: Any, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.batch_sampler), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip)


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
