"""How a prepared loader is sharded over the data-parallel ranks: the user's DataLoader rebuilt
around the sampler that deals this rank its part, every other setting kept.

- a stream (IterableDataset): split by data/streams.py (by rank only when it splits itself over workers),
  unless it shards itself by rank;
- the script's own DistributedSampler: taken over (data/rank_sampler.py);
- DataLoader's default samplers (`shuffle=True/False`): phalanx's ShardedSampler;
- any other sampler under DataLoader's own BatchSampler: its draw kept, dealt index by index;
- a custom batch sampler: its whole batches dealt to ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from phalanx.data.rank_sampler import TakenOverSampler, shards_by_rank
from phalanx.data.sample_seeds import SampleSeeded
from phalanx.data.sampler import BatchShardSampler, ShardedSampler
from phalanx.data.streams import stream_for_rank
from phalanx.data.user_sampler import UserSampler
from phalanx.logging.rank_log import get_logger
from phalanx.runtime.context import DistContext

# DataLoader arguments carried over verbatim when the loader is rebuilt around a new sampler.
CARRIED = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def is_stateful(loader: DataLoader) -> bool:
    """A DataLoader subclass that saves and restores its own position (torchdata's StatefulDataLoader)."""
    return (
        type(loader) is not DataLoader
        and callable(getattr(loader, "state_dict", None))
        and callable(getattr(loader, "load_state_dict", None))
    )


def carried(loader: DataLoader) -> dict[str, Any]:
    """The loader's settings to rebuild it with (workers, collate_fn, pinning...)."""
    kwargs = {name: getattr(loader, name) for name in CARRIED if hasattr(loader, name)}
    if kwargs.get("num_workers", 0) == 0:
        kwargs["persistent_workers"] = False
    else:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return kwargs


def shard_loader(
    loader: DataLoader, ctx: DistContext, seed: int, sample_seeds: bool = True, batch_size: int | None = None
) -> DataLoader:
    """Rebuild `loader` so this data-parallel rank sees its shard, in batches of `batch_size` (the
    loader's own unless split_batches divided it); keep every other setting.

    `sample_seeds`: a map-style dataset loaded by workers seeds each sample from (seed, epoch, index)
    (data/sample_seeds.py), except in a stateful loader, which restores its workers' state itself.
    """
    batch_size = loader.batch_size if batch_size is None else batch_size
    kwargs = carried(loader)
    if is_stateful(loader):  # rebuilt as the same class, with its own settings
        kwargs["loader_class"] = type(loader)
        if hasattr(loader, "snapshot_every_n_steps"):
            kwargs["snapshot_every_n_steps"] = loader.snapshot_every_n_steps
    dataset = loader.dataset
    generator = torch.Generator()
    generator.manual_seed(seed)
    if isinstance(dataset, IterableDataset):
        stream = stream_for_rank(dataset, ctx, seed, loader.num_workers)
        if stream is None:  # it shards itself by rank: sharding it again would lose data
            return loader
        return build(stream, batch_size=batch_size, drop_last=loader.drop_last, generator=generator, **kwargs)
    tag_epoch = sample_seeds and kwargs.get("num_workers", 0) > 0 and not is_stateful(loader)
    if tag_epoch:
        dataset = SampleSeeded(dataset, seed)
    if loader.batch_size is not None and shards_by_rank(loader.sampler):  # the script's DistributedSampler
        taken = TakenOverSampler(loader.sampler, ctx.dp_size, ctx.dp_rank, tag_epoch=tag_epoch)
        get_logger("data").info("%s", taken.describe(ctx.dp_size))
        return build(
            dataset, batch_size=batch_size, sampler=taken, drop_last=loader.drop_last, generator=generator, **kwargs
        )
    shuffle = _default_shuffle(loader)
    if shuffle is not None:
        sharded = ShardedSampler(
            dataset,
            num_replicas=ctx.dp_size,
            rank=ctx.dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=loader.drop_last,
            tag_epoch=tag_epoch,
        )
        return build(
            dataset, batch_size=batch_size, sampler=sharded, drop_last=loader.drop_last, generator=generator, **kwargs
        )
    if _deals_indices(loader):  # the user's own sampler: its draw is kept, dealt index by index
        kept = UserSampler(
            loader.sampler, ctx.dp_size, ctx.dp_rank, seed=seed, drop_last=loader.drop_last, tag_epoch=tag_epoch
        )
        return build(
            dataset, batch_size=batch_size, sampler=kept, drop_last=loader.drop_last, generator=generator, **kwargs
        )
    # A custom batch sampler: deal its whole batches to ranks.
    batch_sampler = loader.batch_sampler
    if batch_sampler is None:  # batch_size=None: the sampler yields single samples
        raise ValueError(
            "phalanx cannot shard a DataLoader built with batch_size=None. "
            "Give it a batch_size (or a batch_sampler) so batches can be dealt to ranks."
        )
    drop_last = bool(getattr(batch_sampler, "drop_last", False))
    shard = BatchShardSampler(
        batch_sampler, ctx.dp_size, ctx.dp_rank, drop_last=drop_last, tag_epoch=tag_epoch, seed=seed
    )
    return build(dataset, batch_sampler=shard, generator=generator, **kwargs)


def build(dataset: Any, loader_class: type = DataLoader, **kwargs: Any) -> DataLoader:
    return loader_class(dataset, **kwargs)


_TORCHDATA_SAMPLERS = "torchdata.stateful_dataloader.sampler"  # StatefulDataLoader's own default samplers


def _is(obj: Any, torch_class: type) -> bool:
    """`obj` is `torch_class` exactly, or torchdata's stateful class of the same name."""
    cls = type(obj)
    return cls is torch_class or (cls.__name__ == torch_class.__name__ and cls.__module__ == _TORCHDATA_SAMPLERS)


def _default_shuffle(loader: DataLoader) -> bool | None:
    """True/False when the loader's samplers are the ones DataLoader(shuffle=True/False) builds
    (torch's or, for a StatefulDataLoader, torchdata's); None for a custom sampler."""
    if loader.batch_size is None or not _is(loader.batch_sampler, BatchSampler):
        return None
    sampler = loader.sampler
    if isinstance(sampler, RandomSampler) or _is(sampler, RandomSampler):
        # Only shuffle=True's own sampler: replacement, num_samples or a generator of the user's
        # change what is drawn, and are kept (user_sampler.UserSampler)
        # (torchdata's own always holds a generator of its making)
        plain = (
            not sampler.replacement
            and sampler._num_samples is None
            and (sampler.generator is None or type(sampler).__module__ == _TORCHDATA_SAMPLERS)
        )
        return True if plain else None
    return False if type(sampler) is SequentialSampler or _is(sampler, SequentialSampler) else None


def _deals_indices(loader: DataLoader) -> bool:
    """A sampler phalanx keeps (custom, weighted, with replacement...) under DataLoader's own BatchSampler:
    its draw is dealt index by index (UserSampler)."""
    return loader.batch_size is not None and _is(loader.batch_sampler, BatchSampler)
