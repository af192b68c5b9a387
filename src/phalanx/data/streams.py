"""Which split a prepared loader gives an IterableDataset: by shard where the source has shards, item by
item otherwise (data/streaming.py, data/iterable.py; docs/data.md)."""

from __future__ import annotations

from torch.utils.data import IterableDataset

from phalanx.data.iterable import ShardedIterable, say_item_split, shards_itself, splits_over_workers
from phalanx.data.streaming import ShardedStream, is_hf_iterable, split_by_script, split_hf_iterable
from phalanx.runtime.context import DistContext


def stream_for_rank(dataset: IterableDataset, ctx: DistContext, seed: int, num_workers: int) -> IterableDataset | None:
    """`dataset` as data-parallel rank `ctx.dp_rank` reads it, each item once in the whole job; None for a
    dataset that shards itself by rank (its `__iter__` reads the rank, or the script split it with
    datasets' `split_dataset_by_node`): used as it is.

    Workers are split too, even in a world of one: a DataLoader's workers each replay an unsplit stream.
    A stream that splits itself over workers only (torch's docs' `get_worker_info()` example) is split
    by rank on top of its own split; in a world of one it is used as it is.
    """
    if isinstance(dataset, ShardedStream):
        return dataset.for_ranks(ctx.dp_rank, ctx.dp_size, seed)
    if is_hf_iterable(dataset):
        if split_by_script(dataset, ctx.dp_rank, ctx.dp_size):  # split_dataset_by_node in the script
            return None
        return split_hf_iterable(dataset, ctx.dp_rank, ctx.dp_size)
    if shards_itself(dataset):
        return None
    if splits_over_workers(dataset):  # each rank's workers read their parts: split by rank only
        if ctx.dp_size == 1:
            return None
        say_item_split(dataset, ctx.dp_size, by_worker=False)
        return ShardedIterable(dataset, ctx.dp_rank, ctx.dp_size, seed, by_worker=False)
    say_item_split(dataset, ctx.dp_size * max(num_workers, 1))
    return ShardedIterable(dataset, ctx.dp_rank, ctx.dp_size, seed)
